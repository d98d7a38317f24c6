"""What a compiled graph baked in of a model, and a check, cheap enough for every step, that
none of it changed since.

A compiled target step runs without dynamo's guards (step_graph.py: they cost a quarter of a
decode step), so nothing in torch notices when the model under a graph changes; the graph
would go on computing the model as it was. What a graph bakes in, beyond its inputs:

    config values          the model's config and those of the modules the step runs
    attention functions    what transformers' registry holds for the configs' implementations
    module attributes      the plain values (numbers, strings, flags, functions) that the
                           step's modules' code reads as `self.<name>`: `training`, an RMS
                           norm's `variance_epsilon` (rms_norm_eps, copied at init), `scaling`
    hooks                  forward / backward (pre-)hooks of those modules; global module hooks
    the module tree        every module's identity and class, every parameter's and buffer's
                           identity, dtype, device and shape

`Baked(model, ran)` fingerprints it (`ran`: the modules a step's forward calls: `modules_run`);
`changed()` says whether the model still matches: None, or what changed.

Cost. The fingerprint walks the model (1-9 ms for 4-28 layers on the 2-core CPU). Per step, `changed()`
compares what is small directly and counts the rest:
- hook registrations anywhere bump torch's `RemovableHandle.next_id`;
- module, parameter and buffer registrations (a replaced layer or weight) bump `_EDITS`,
  counted by global registration hooks installed once;
- hook removals shrink the hook dicts that held hooks (their total length is compared;
  transformers' output-capture hooks are never removed: their dicts are not watched);
- config values and module attributes are compared with snapshots that hold the same objects
  (an identity test each, unless changed); the first and last parameters' data pointers
  (`Module.to` and `.data =` give them new storage).
When one of these moved, the whole fingerprint is taken again and compared, and the verdict
kept until something moves again (a hook added and removed again reads as unchanged). Not
seen: an attribute read other than as `self.<name>` in its module's code, and a partial dtype
conversion that spares the first and last parameters, until a counter moves.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import operator
import re
import threading
import types
from itertools import chain

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
_SELF_ATTR = re.compile(r"self\.(\w+)")

_EDITS = [0]                        # module / parameter / buffer registrations in this process
_WATCH_LOCK = threading.Lock()
_WATCHING: list = []                # the registration hooks' handles, once installed


def _count_edit(*_) -> None:        # returns None: the registration goes on unchanged
    _EDITS[0] += 1


def _watch_edits() -> None:
    with _WATCH_LOCK:
        if not _WATCHING:
            _WATCHING.extend(register(_count_edit) for register in (
                nn_module.register_module_module_registration_hook,
                nn_module.register_module_parameter_registration_hook,
                nn_module.register_module_buffer_registration_hook))


@contextlib.contextmanager
def modules_run():
    """The modules whose forward runs inside the block (a dict by id, in the order first
    called): give it a step's eager forward to learn which modules its graph holds. No other
    thread's forward may run meanwhile (the hook is global: compiling.GATE's compile side)."""
    ran: dict[int, nn.Module] = {}

    def seen(module: nn.Module, args) -> None:
        ran.setdefault(id(module), module)
    handle = nn_module.register_module_forward_pre_hook(seen)
    try:
        yield ran
    finally:
        handle.remove()


class Baked:
    """A model's fingerprint as a graph baked it in, and the per-step check (module doc)."""

    def __init__(self, model: nn.Module, ran: list[nn.Module] | None = None):
        _watch_edits()
        self.model = model
        own = list(model.modules())
        ids = {id(m) for m in own}
        self.ran = own if ran is None else [m for m in ran if id(m) in ids]   # not another model's (a draft's)
        self.rechecks = 0                       # fingerprints taken again after a counter moved
        self._lock = threading.Lock()
        self._baked = self._fingerprint()
        self._now = _Cheap(self)

    def changed(self) -> str | None:
        """None while the model is as the graph baked it; else what changed."""
        now = self._now
        try:
            holds = now.holds()
        except Exception:           # noqa: BLE001 - e.g. a watched attribute deleted: a change
            holds = False
        if holds:
            return now.verdict
        with self._lock:
            if self._now is now:
                self.rechecks += 1
                cheap = _Cheap(self)            # read before the fingerprint: a change meanwhile shows next step
                cheap.verdict = self._difference(self._fingerprint())
                self._now = cheap
            return self._now.verdict

    def _fingerprint(self) -> dict:
        model = self.model
        configs = _configs(model, self.ran)
        tensors = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
        return {
            "config": [_snapshot(vars(c)) for c in configs],
            "attention functions": [ALL_ATTENTION_FUNCTIONS.get(name) for name in _attention_names(configs)],
            "module attributes": [(names, _snapshot(vars(m), names)) for m in self.ran for names in [_watched(m)]],
            "hooks": ([tuple(tuple(getattr(m, name)) for name in _HOOK_DICTS) for m in self.ran],
                      [tuple(getattr(nn_module, name)) for name in _GLOBAL_HOOKS]),
            "module tree": [(name, m, type(m)) for name, m in model.named_modules(remove_duplicate=False)],
            "parameters and buffers": [(name, t, None if t is None else (t.dtype, t.device, tuple(t.shape)))
                                       for name, t in tensors],
        }

    def _difference(self, now: dict) -> str | None:
        for part, baked in self._baked.items():
            if not _same(baked, now[part]):
                return f"its {part} changed since the graph was compiled"
        return None


class _Cheap:
    """What of a model compares in a few microseconds, as it was at one moment, and the
    verdict (None: as the graph baked it) that goes with it."""

    __slots__ = ("handles", "edits", "hook_dicts", "hooks", "groups", "values", "few_gets", "few_dicts", "few_values",
                 "params", "pointers", "names", "attn_gets", "attn", "verdict")

    def __init__(self, baked: Baked):
        self.handles, self.edits = RemovableHandle.next_id, _EDITS[0]
        self.hook_dicts = [d for m in baked.ran for d in (getattr(m, name) for name in _HOOK_DICTS)
                           if d and not all(map(_permanent, d.values()))]
        self.hook_dicts += [getattr(nn_module, name) for name in _GLOBAL_HOOKS]
        self.hooks = sum(map(len, self.hook_dicts))
        # All of each config's values and each module's watched attributes: one getter for the
        # dicts that share one (a class's modules, one a layer: a map over them), the few others
        # in one map of their own.
        by_names: dict[tuple, list[dict]] = {}
        for m in baked.ran:
            if names := _watched(m):
                by_names.setdefault(names, []).append(vars(m))
        self.groups = [(operator.itemgetter(*names), dicts) for names, dicts in by_names.items() if len(dicts) >= 4]
        self.values = [[_kept(got, names) for got in map(get, dicts)]
                       for (get, dicts), names in zip(self.groups, [n for n, d in by_names.items() if len(d) >= 4])]
        few = [(_values, vars(c), ()) for c in _configs(baked.model, baked.ran)]
        few += [(operator.itemgetter(*names), d, names) for names, dicts in by_names.items() if len(dicts) < 4
                for d in dicts]
        self.few_gets, self.few_dicts = [get for get, _, _ in few], [d for _, d, _ in few]
        self.few_values = [_kept(get(d), names) for get, d, names in few]
        params = list(baked.model.parameters())
        self.params = [params[0], params[-1]] if params else []
        self.pointers = list(map(torch.Tensor.data_ptr, self.params))
        # transformers' registry looks a name up in the instance's own mapping, then the class's
        names = list(dict.fromkeys(_attention_names(_configs(baked.model, baked.ran))))
        mappings = [getattr(ALL_ATTENTION_FUNCTIONS, name, None) for name in ("_local_mapping", "_global_mapping")]
        gets = [m.get for m in mappings] if all(isinstance(m, dict) for m in mappings) else [ALL_ATTENTION_FUNCTIONS.get]
        self.attn_gets = gets * len(names)
        self.names = [name for name in names for _ in gets]
        self.attn = list(map(operator.call, self.attn_gets, self.names))
        self.verdict: str | None = None

    def holds(self) -> bool:
        """Whether the model still is as it was (a key added to a config, or an equal value put
        in place of one, reads as a change here: the fingerprint then decides)."""
        return (RemovableHandle.next_id == self.handles and _EDITS[0] == self.edits
                and sum(map(len, self.hook_dicts)) == self.hooks
                and [list(map(get, dicts)) for get, dicts in self.groups] == self.values
                and list(map(operator.call, self.few_gets, self.few_dicts)) == self.few_values
                and list(map(torch.Tensor.data_ptr, self.params)) == self.pointers
                and list(map(operator.call, self.attn_gets, self.names)) == self.attn)


def _permanent(hook) -> bool:
    """transformers' output-capture hook: installed once on a module and never removed (no one
    keeps its handle), so its dict needs no watching for removals."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _values(d: dict) -> tuple:
    return tuple(d.values())


def _keep(value):
    """A value as a snapshot holds it: deep-copied, so an immutable one comes back as itself
    (comparing the snapshot with the live value is an identity test) and a list or dict changed
    in place reads as changed; a sub-config (it has its own snapshot) and a function as themselves."""
    if isinstance(value, (PretrainedConfig, types.FunctionType, types.BuiltinFunctionType)):
        return value
    return copy.deepcopy(value)


def _kept(got, names: tuple[str, ...]):
    """What a getter of `names` got (a tuple of values for several, or for all: (), else the
    value), kept."""
    return tuple(map(_keep, got)) if len(names) != 1 else _keep(got)


def _snapshot(d: dict, names: tuple[str, ...] | None = None) -> dict:
    return {k: _keep(d[k]) for k in (d if names is None else names)}


def _configs(model: nn.Module, ran: list[nn.Module]) -> list[PretrainedConfig]:
    """The model's config and the configs of the modules `ran`: what the step's code can read
    (a vision tower's config is not, in a text step)."""
    found = []
    for m in [model, *ran]:
        c = getattr(m, "config", None)
        if isinstance(c, PretrainedConfig) and all(c is not f for f in found):
            found.append(c)
    return found


def _attention_names(configs: list[PretrainedConfig]) -> list[str]:
    return [name for c in configs if isinstance(name := getattr(c, "_attn_implementation_internal", None), str)]


def _plain(value) -> bool:
    """A value dynamo bakes into a graph as a constant (or by identity, a function)."""
    if value is None or isinstance(value, (bool, int, float, str, types.FunctionType, types.BuiltinFunctionType)):
        return True
    return isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value)


def _watched(module: nn.Module) -> tuple[str, ...]:
    """The module's plain attributes its code reads (all its plain attributes where the code
    cannot be read)."""
    names = _read_names(type(module))
    return tuple(sorted(k for k, v in vars(module).items() if (names is None or k in names) and _plain(v)))


@functools.lru_cache(maxsize=None)
def _read_names(cls: type) -> frozenset[str] | None:
    """The names a module's forward reads as `self.<name>`: in `forward` and `__call__` (every
    class's of the MRO but nn.Module's, and what they wrap) and in the methods they call as
    `self.<method>`, and so on; None where one of those methods' source cannot be read."""
    methods: dict[str, list] = {}
    for klass in cls.__mro__:
        if klass not in (nn.Module, object):
            for name, fn in vars(klass).items():
                fn = getattr(fn, "__func__", fn)
                if inspect.isfunction(fn):
                    methods.setdefault(name, []).append(fn)
    names: set[str] = set()
    todo, seen = ["forward", "__call__"], set()
    while todo:
        method = todo.pop()
        if method in seen or method not in methods:
            continue
        seen.add(method)
        for fn in methods[method]:
            while fn is not None:           # a wrapper (functools.wraps) and what it wraps
                try:
                    found = _SELF_ATTR.findall(inspect.getsource(fn.__code__))
                except (OSError, TypeError):
                    return None
                names.update(found)
                todo.extend(found)
                fn = getattr(fn, "__wrapped__", None)
    return frozenset(names)


def _same(a, b) -> bool:
    """Equal, with modules and tensors compared by identity (never elementwise)."""
    if isinstance(a, (nn.Module, torch.Tensor)) or isinstance(b, (nn.Module, torch.Tensor)):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
