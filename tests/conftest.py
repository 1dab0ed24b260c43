import os
import sys

# Tests import the trainer's files (model.py, ddp.py, ...) and the harness from the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
