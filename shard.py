"""What a local tensor is of the logical one: the record every parameter and piece of training state carries.

The model (model.py) is one logical GPT. Each axis cuts its tensors on the ranks: tensor parallel splits a
dimension, expert parallel keeps some experts, a pipeline stage keeps some blocks, ZeRO keeps a flat range.
`ShardInfo` says, for one local tensor, which logical tensor it belongs to and where it sits in it (`Split`s,
applied in order), over which mesh axes identical copies of it exist, and over which group data-parallel
replicas sum its gradient. The checkpoint (which copy is written, where each piece goes), the gradient norm
(each logical element counted once: `counts_here`) and the parameter counts of the accounting all read this
one record; none of them special-cases an axis. `StatePiece` is one local tensor of training state with its
record: what the layouts hand the checkpoint. `set_value` gives a parameter a new value (a shard, a view into
a flat buffer) without replacing the object the axes and the layouts hold on to.

The model knows nothing of records: `describe` gives each of its parameters the record of the whole logical
tensor (named by `GPT.global_name`), which the axes then cut; `materialize` gives each kept local tensor its
value from the logical tensor's initial value (`GPT.initial_value`), then its piece (`initial_local`).
`positions` says the same of a sequence: which tokens a context-parallel (or sequence-parallel) piece holds.

Accounting for this file: it holds no tensors of its own and sends nothing; a record is a few Python values
per parameter. Restart state: none of its own (the checkpoint writes each record's global name, shape and
slice into its manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Split:
    """The local tensor is piece `index` of `num` equal pieces along dimension `dim`.

    With `segments` > 1 the dimension is made of that many equal segments (c_attn's fused [q | k | v]) and the
    piece is this rank's part of every segment, concatenated (its heads of q, of k and of v).
    """

    dim: int
    num: int
    index: int
    segments: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        pieces = [segment.chunk(self.num, self.dim)[self.index] for segment in full.chunk(self.segments, self.dim)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        for segment, piece in zip(full.chunk(self.segments, self.dim), local.chunk(self.segments, self.dim)):
            segment.chunk(self.num, self.dim)[self.index].copy_(piece)


@dataclass
class ShardInfo:
    """The one record of a parameter's place in the logical model, read by checkpoints, grad norm, accounting.

    `global_name`/`global_shape` name the logical tensor. `splits` cut it, in order (tensor parallel splits a
    dimension; expert parallel the expert dimension; both may apply): the local tensor is
    `splits[-1].take(... splits[0].take(full))`.
    `replicated_over` names the mesh axes over which IDENTICAL copies of this local tensor exist: "tp" for
    LayerNorms and row-parallel biases under tensor parallel, "pp" for the embedding tied between the first
    and the last pipeline stage. The copy on coordinate 0 of each of those axes is the one that counts
    (`counts_here`): the gradient norm adds it once and the checkpoint writes it once.
    `grad_group` is the mesh group over which data-parallel replicas of the tensor sum their gradients:
    "dp_cp" for dense parameters, "expert_dp" for experts (fewer replicas: the ranks holding the same experts).
    `replica` > 0 marks a redundant copy of a hot expert in another physical slot (experts/eplb.py): identical to the
    replica-0 copy, which is the one that counts.
    """

    global_name: str
    global_shape: tuple
    splits: tuple = ()
    replicated_over: tuple = ()
    grad_group: str = "dp_cp"
    replica: int = 0

    @property
    def local_shape(self) -> tuple:
        shape = list(self.global_shape)
        for split in self.splits:
            shape[split.dim] //= split.num
        return tuple(shape)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of the global tensor `full` (a copy for fused segments, else a view)."""
        for split in self.splits:
            full = split.take(full)
        return full

    def place_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write the local piece into its place in the global tensor `full` (the inverse of shard_of)."""
        if not self.splits:
            full.copy_(local)
            return
        outer = [full]  # the tensor each split cuts: full, then its first piece, ...
        for split in self.splits[:-1]:
            outer.append(split.take(outer[-1]).clone())
        self.splits[-1].put(outer[-1], local)
        for split, parent, piece in zip(reversed(self.splits[:-1]), reversed(outer[:-1]), reversed(outer[1:])):
            split.put(parent, piece)  # fused segments are copies: write each level back into its parent

    def replicated_also_over(self, *axes: str) -> ShardInfo:
        return replace(self, replicated_over=tuple(dict.fromkeys(self.replicated_over + axes)))


def counts_here(info: ShardInfo | None, coords: dict | None, replica_axes: tuple = ()) -> bool:
    """Whether this rank's copy of a tensor is THE copy: counted in the gradient norm, Ψ, written to disk.

    A tensor identical over the axes `info.replicated_over` (plus `replica_axes`, the data-parallel group of a
    layout that replicates it) counts on coordinate 0 of each of them. `coords` maps an axis or group name
    to this rank's index in it (`Mesh.coordinates()`); None means one process (everything counts). A redundant
    expert's replica > 0 never counts.
    """
    if info is not None and info.replica:
        return False
    if info is None or coords is None:
        return True
    return all(coords.get(axis, 0) == 0 for axis in (*info.replicated_over, *replica_axes))


@dataclass
class StatePiece:
    """One local tensor of training state and where it sits in its logical tensor: what checkpoints move.

    Every layout lists its state as pieces; saving reads `tensor`, loading copies into it (it is the live
    storage). A piece is the `shard` (TP/EP split) of the logical tensor, and of that, when `flat_range` is
    set, the elements [start, end) of the flattened split (a ZeRO shard). `primary` is False on a replica
    whose identical twin on another rank is the one written.
    """

    key: str  # "<kind>/<global name>", kind: param | master | exp_avg | exp_avg_sq
    tensor: torch.Tensor
    shard: ShardInfo
    flat_range: tuple | None = None
    primary: bool = True
    optional: bool = False  # a checkpoint without it loads, the live value staying (an axis's state: experts/eplb.py)


def describe(module: nn.Module) -> nn.Module:
    """Give every parameter of `module` that has no record one: the whole logical tensor, named by the module's
    `global_name` (a GPT's: the head's tied copy is the embedding's), else by its own name. Idempotent: the axes
    and layouts that read records call it on what they are handed; a record an axis has cut stays. Returns it."""
    global_name = getattr(module, "global_name", lambda name: name)
    for name, param in module.named_parameters():
        if getattr(param, "shard_info", None) is None:
            param.shard_info = ShardInfo(global_name=global_name(name), global_shape=tuple(param.shape))
    return module


def initial_local(info: ShardInfo, initial_value, dtype: torch.dtype) -> torch.Tensor:
    """The initial value of the local tensor `info` describes: its logical tensor's (`initial_value(name, shape,
    dtype)`, GPT.initial_value), cut by its splits, in its own storage (a view would keep the whole logical tensor
    alive). Transient: that one logical tensor plus the piece."""
    full = initial_value(info.global_name, info.global_shape, dtype)
    return info.shard_of(full).clone(memory_format=torch.contiguous_format)


@torch.no_grad()
def materialize(module: nn.Module, device, initial_value) -> nn.Module:
    """Give every meta parameter of `module` (a GPT, or a part of one: a block) its initial value on `device`,
    one at a time, from its record: what a rank keeps after the axes cut the model on meta, bitwise equal to
    slicing the single-device model. `initial_value`: the model's (GPT.initial_value). The parameter objects
    stay the same (`set_value`), so ties and whatever the axes hold on to (FP8's linears, TP's SP list, the
    layout) see the values. Peak: what is kept plus one logical tensor and its piece."""
    describe(module)
    for param in module.parameters():  # each tensor once (a tied one too)
        if param.is_meta:
            set_value(param, initial_local(param.shard_info, initial_value, param.dtype).to(device))
    return module


def positions(seq_len: int, pieces: int, index: int, balance: str = "zigzag") -> torch.Tensor:
    """The global positions of piece `index` of `pieces` of a sequence of `seq_len` tokens, in the order that
    piece holds them (ascending): context parallel's cut, zig-zag (chunks index and 2C−1−index of 2C: every piece
    gets as much causal work) or contiguous (sequence parallel's, and CP's other cut)."""
    if balance == "contiguous":
        piece = seq_len // pieces
        return torch.arange(index * piece, (index + 1) * piece)
    n = seq_len // (2 * pieces)
    early, late = index, 2 * pieces - 1 - index
    return torch.cat([torch.arange(early * n, (early + 1) * n), torch.arange(late * n, (late + 1) * n)])


def set_value(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make `param` hold `value` (its shape; it may be a view into a layout's flat buffer), keeping the object, so
    its ShardInfo, ties and whatever holds it stay valid, and its own version counter (`.data =` semantics: a
    write into the rest of a flat buffer, a ZeRO-3 regather, does not invalidate what autograd saved of it). A
    meta parameter cannot take `.data` from another device (torch refuses): a new parameter takes it, and the
    two swap contents (torch.utils.swap_tensors)."""
    if not param.is_meta:
        param.data = value
        return
    new = nn.Parameter(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=param.requires_grad)
    new.data = value
    new.__dict__.update(param.__dict__)  # shard_info (swap_tensors swaps the attributes too)
    torch.utils.swap_tensors(param, new)
