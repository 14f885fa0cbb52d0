"""A model's weights one tensor at a time, to fill a skeleton built on the meta device (``torch.device("meta")``).

Two sources, both iterators of ``(name, full tensor)`` over a model's ``named_parameters`` and ``named_buffers``
(tied parameters once), each tensor freed by the source once the consumer has it:

- ``checkpoint_tensors``: a Hugging Face directory's safetensors files (the cold-start cache, ``model.path``), read
  tensor by tensor; a Qwen3-MoE layer's per-expert checkpoint tensors are fused into transformers 5's
  ``gate_up_proj`` / ``down_proj`` as ``from_pretrained`` fuses them.
- ``random_init_tensors``: the weights ``trainers.models.model_from_config`` draws for a seed, bit for bit, without
  ever holding the whole model. Building the model on the meta device under ``InitRecorder`` lists every in-place
  op that writes a parameter or buffer, in order (the constructors' ``kaiming_uniform_``, then transformers'
  ``_init_weights``); replaying that list on one scratch tensor per op, on the device the plain build draws on,
  consumes the generator exactly as the plain build does, because a CPU or CUDA draw consumes the stream by its
  op, shape and dtype only. A write through a view of a weight (e.g. zeroing an embedding's padding row) is not
  replayed: ``InitRecorder`` raises, naming the op; none of the presets' inits makes one.

A consumer that keeps only its shard of each tensor (``dcmdp.distributed.load_shards``) then holds its shards plus
one full tensor (two while a fused MoE tensor is assembled) at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

# In-place ops that replace every element of their target whatever it held: the replay draws them on a fresh tensor.
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "exponential_", "geometric_",
               "log_normal_", "cauchy_", "bernoulli_"}


def model_tensors(model: torch.nn.Module) -> dict[str, Tensor]:
    """Every parameter (tied ones once) and buffer of ``model`` by its state-dict name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class InitRecorder(TorchDispatchMode):
    """Records, in order, each in-place op that writes one of ``tensors`` (name -> tensor), as (name, op, args,
    kwargs); runs the op as asked (on meta tensors it costs nothing)."""

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        self.names = {id(t): n for n, t in tensors.items()}
        self.ops: list[tuple[str, object, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        writes = bool(schema.arguments) and schema.arguments[0].alias_info is not None and \
            schema.arguments[0].alias_info.is_write
        if writes and args and isinstance(args[0], Tensor):
            name = self.names.get(id(args[0]))
            if name is None and args[0].device.type == "meta" and args[0]._base is not None and \
                    id(args[0]._base) in self.names:
                raise NotImplementedError(f"the init writes {self.names[id(args[0]._base)]} through a view "
                                          f"({func}): the per-tensor replay cannot follow it")
            if name is not None:
                self.ops.append((name, func, tuple(args[1:]), dict(kwargs)))
        return func(*args, **kwargs)


class InitOp(NamedTuple):
    """One in-place write of a parameter during a model's construction (``record_init``)."""

    name: Optional[str]  # the parameter's state-dict name; None: a parameter the finished model no longer holds
    shape: torch.Size
    dtype: torch.dtype
    func: Any  # the aten op
    args: tuple  # its arguments after the target
    kwargs: dict


def record_init(config, cls) -> tuple[torch.nn.Module, list[InitOp]]:
    """(``cls(config)`` with its parameters on the meta device, the in-place writes its construction makes to them).

    The construction runs as in a plain build, ``post_init`` and its ``initialize_weights`` included (transformers
    skips them under ``torch.device("meta")``, so that context is not used): each parameter is moved to the meta
    device as it is registered, before its constructor's init writes it, so a moment holds at most one real
    parameter. Buffers (the rotary frequencies) stay real and are left out of the list (``init_buffers``)."""
    recorder = InitRecorder({})
    keys: dict[int, str] = {}
    alive: list[Tensor] = []  # every recorded parameter stays referenced, so no id is reused while recording
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)
        if param is not None and id(param) not in keys:  # a parameter registered twice (tied) keeps its key
            recorder.names[id(param)] = keys[id(param)] = key = f"{id(module)}.{name}.{len(keys)}"
            shapes[key] = (param.shape, param.dtype)
            alive.append(param)

    torch.nn.Module.register_parameter = register
    try:
        with recorder:
            model = cls(config)
    finally:
        torch.nn.Module.register_parameter = original
    # construction-time keys -> state-dict names; a parameter replaced later (a tied head's own) has none, but its
    # draws stay in the list: they advance the generator in the plain build too
    names = {keys[id(p)]: n for n, p in model.named_parameters()}
    return model, [InitOp(names.get(k), shapes[k][0], shapes[k][1], f, a, kw) for k, f, a, kw in recorder.ops]


def random_init_tensors(ops: list[InitOp], *, seed: int, device: torch.device | str = "cpu"
                        ) -> Iterator[tuple[str, Tensor]]:
    """The final value of every parameter ``ops`` writes (``record_init``), replayed from ``seed`` on ``device``;
    the global RNG state is left untouched. A tensor is yielded after its last write and dropped from the replay
    then; between two writes only a tensor that the later op reads (does not overwrite) is kept."""
    device = torch.device(device)
    last = {op.name: i for i, op in enumerate(ops)}
    keep = set()  # indices whose result the next op on the same parameter reads
    following: dict[Optional[str], int] = {}
    for i in range(len(ops) - 1, -1, -1):
        name = ops[i].name
        if name is not None and name in following and func_name(ops[following[name]].func) not in _OVERWRITES:
            keep.add(i)
        following[name] = i
    current: dict[str, Tensor] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for i, op in enumerate(ops):
            target = current.pop(op.name, None) if op.name is not None else None
            if target is None:
                target = torch.empty(op.shape, dtype=op.dtype, device=device)
            args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in op.args)
            with torch.no_grad():
                op.func(target, *args, **op.kwargs)
            if op.name is not None and i == last[op.name]:
                yield op.name, target
            elif i in keep:
                current[op.name] = target
            del target


def func_name(func) -> str:
    return func._schema.name.split("::")[-1]


# safetensors dtype names -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One ``.safetensors`` file read one tensor at a time into memory of its own.

    The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets into the
    data that follows), the data. The ``safetensors`` package's torch reader maps the whole file into one storage
    that every tensor views (the allocator counts the whole file while any tensor is alive); reading each tensor's
    bytes into a fresh tensor holds that tensor only."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header = {k: v for k, v in json.loads(f.read(size)).items() if k != "__metadata__"}
        self.data_start = 8 + size

    def read(self, name: str) -> Tensor:
        meta = self.header[name]
        begin, end = meta["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            if f.readinto(raw.numpy()) != end - begin:
                raise ValueError(f"{self.path}: {name} is truncated")
        return raw.view(_ST_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def _checkpoint_files(model_dir: str) -> dict[str, SafetensorsFile]:
    """Checkpoint tensor name -> the safetensors file that holds it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {name: SafetensorsFile(os.path.join(model_dir, name)) for name in set(weight_map.values())}
        return {k: files[v] for k, v in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no safetensors weights in {model_dir!r} (model.safetensors or its index)")
    st = SafetensorsFile(single)
    return {k: st for k in st.header}


def checkpoint_tensors(model: torch.nn.Module, model_dir: str) -> Iterator[tuple[str, Tensor]]:
    """Each parameter of ``model`` read from the safetensors of ``model_dir``, full, in the parameter's dtype, one
    at a time. Buffers (rotary frequencies) are not in a checkpoint: ``init_buffers`` sets them."""
    files = _checkpoint_files(model_dir)

    def read(key: str) -> Tensor:
        if key not in files:
            raise KeyError(f"{model_dir}: the checkpoint has no tensor {key!r}")
        return files[key].read(key)

    for name, param in model.named_parameters():
        pieces = checkpoint_names(name, param.shape)
        if len(pieces) == 1:
            tensor = read(name)
        elif name.endswith("gate_up_proj"):  # (E, 2I, H): each expert's gate rows, then its up rows
            tensor = torch.stack([torch.cat([read(gate), read(up)]) for (gate, *_), (up, *_) in zip(pieces[::2],
                                                                                                     pieces[1::2])])
        else:  # (E, H, I)
            tensor = torch.stack([read(key) for key, *_ in pieces])
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{model_dir}: {name} has shape {tuple(tensor.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        tensor = tensor.to(param.dtype)
        yield name, tensor
        del tensor


def init_buffers(model: torch.nn.Module) -> None:
    """Set the buffers of a model materialised from the meta device (``to_empty`` leaves them uninitialised) as its
    construction computes them: transformers' ``_init_weights`` writes every rotary embedding's ``inv_freq`` and
    ``original_inv_freq``; a module with another buffer is an error, not a buffer left as garbage."""
    for module in model.modules():
        own = [n for n, b in module._buffers.items() if b is not None]
        if not own:
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise NotImplementedError(f"{type(module).__name__} has buffers {own}: only rotary embeddings' are set "
                                      f"after a meta-device build")
        module.__dict__.pop("_is_hf_initialized", None)
        with torch.no_grad():
            model._init_weights(module)


def checkpoint_names(name: str, shape: torch.Size) -> list[tuple[str, tuple[int, ...], Any]]:
    """The checkpoint tensors that hold model tensor ``name`` of ``shape``, as (name, shape, index into the model
    tensor): a fused Qwen3-MoE expert tensor splits into one tensor per expert and projection, as ``save_pretrained``
    writes it; any other tensor is itself."""
    if name.endswith(".mlp.experts.gate_up_proj"):
        prefix, inter = name[: -len("gate_up_proj")], shape[1] // 2
        return [piece for e in range(shape[0]) for piece in
                ((f"{prefix}{e}.gate_proj.weight", (inter, shape[2]), (e, slice(0, inter))),
                 (f"{prefix}{e}.up_proj.weight", (inter, shape[2]), (e, slice(inter, None))))]
    if name.endswith(".mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        return [(f"{prefix}{e}.down_proj.weight", tuple(shape[1:]), (e,)) for e in range(shape[0])]
    return [(name, tuple(shape), ())]


def save_streamed(model: torch.nn.Module, tensors: Iterator[tuple[str, Tensor]], tokenizer, path: str) -> None:
    """Write ``model``'s parameters, taken one at a time from ``tensors`` (any order), as a Hugging Face directory
    (``model.safetensors`` in checkpoint names, config, tokenizer) at ``path``, replacing it atomically: a model
    that exists only as a source (the replayed random init) reaches an engine that loads from disk while one full
    tensor is in memory. ``model`` (on the meta device) gives the names, shapes and dtypes."""
    import shutil
    import uuid

    names = {v: k for k, v in _ST_DTYPES.items()}
    header, pieces, offset = {}, {}, 0
    for name, param in model.named_parameters():
        pieces[name] = checkpoint_names(name, param.shape)
        for key, shape, _ in pieces[name]:
            size = int(torch.Size(shape).numel()) * param.element_size()
            header[key] = {"dtype": names[param.dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        start = 8 + len(blob)
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            f.truncate(start + offset)
            for name, tensor in tensors:
                tensor = tensor.detach().to("cpu")
                for key, _, index in pieces.pop(name):
                    f.seek(start + header[key]["data_offsets"][0])
                    f.write(tensor[index].contiguous().view(torch.uint8).numpy().tobytes())
        if pieces:
            raise KeyError(f"save_streamed: no weights for {len(pieces)} parameters, e.g. {sorted(pieces)[:3]}")
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
