"""A traced graph as JSON (a Functional model's get_config) and back (its from_config).

The config names the inputs (key, shape, dtype), the layers called at the top of the graph
(class and config, as a Sequential's), and the calls in a topological order: a layer's (its
index, training and keyword arguments) or an op's (its name and attrs), each reading tensors by
reference: ["input", i], ["node", j, output], or ["const", values, dtype]; then the output by
reference ("output"), or several ("outputs", a list: a model with several). A layer of your own is
rebuilt from its config and traced again, so the ops of its call are not in the file, and the
layers it makes in __init__ come back with it. Replaying the calls makes the same graph, whose
layout (names, shapes, order) is the saved one.
"""

from __future__ import annotations

import numpy as np

from pserver.errors import ConfigError
from pserver.layers import deserialize
from pserver.ops import core


def to_config(keys: list[str], inputs: list[core.Symbolic], outputs: list[core.Symbolic], describe) -> dict:
    """The graph from `inputs` to `outputs`; `describe(layers)` gives the layers' configs
    (ConfigError for one that cannot be rebuilt by name)."""
    nodes = topological(outputs)
    refs = {id(x): ["input", i] for i, x in enumerate(inputs)}
    layers: list = []
    calls = []
    for j, node in enumerate(nodes):
        entry = {"inputs": [_ref(t, refs) for t in node.inputs]}
        if node.layer is None:
            entry.update(op=node.op, attrs=_plain(node.attrs))
        else:
            if not any(node.layer is known for known in layers):
                layers.append(node.layer)
            index = next(i for i, known in enumerate(layers) if known is node.layer)
            entry.update(layer=index, list=node.layer.takes_list, training=node.attrs.get("training"),
                         kwargs={k: _value(v, refs) for k, v in node.attrs.get("kwargs", {}).items()})
            by_name = getattr(node.layer, "_dict_keys", None)
            if by_name is not None:               # called on a dict (a traced layer): its keys, in order
                entry["keys"] = list(by_name)
        calls.append(entry)
        for k, out in enumerate(node.outputs):
            refs[id(out)] = ["node", j, k]
    out = [_ref(o, refs) for o in outputs]
    return {"inputs": [{"key": key, "shape": list(x.shape[1:]), "dtype": x.dtype.name}
                       for key, x in zip(keys, inputs)],
            "layers": describe(layers), "nodes": calls,
            **({"output": out[0]} if len(out) == 1 else {"outputs": out})}


def from_config(config: dict) -> tuple[list[str], list[core.Symbolic], list[core.Symbolic]]:
    """(keys, inputs, outputs) of the graph `config` describes, its calls made again."""
    keys = [e["key"] for e in config["inputs"]]
    inputs = [core.Symbolic((None, *e["shape"]), e["dtype"], name=e["key"]) for e in config["inputs"]]
    layers = [deserialize(e) for e in config["layers"]]
    made: list[list] = []
    for entry in config["nodes"]:
        args = [_tensor(r, inputs, made) for r in entry["inputs"]]
        if "op" in entry:
            made.append(_listed(core.apply(entry["op"], *args, **_tuples(entry["attrs"]))))
        else:
            kwargs = {k: _unvalue(v, inputs, made) for k, v in entry["kwargs"].items()}
            made.append(_called(layers[entry["layer"]], args, entry.get("keys"), entry["list"],
                                entry["training"], kwargs))
    refs = config["outputs"] if "outputs" in config else [config["output"]]
    return keys, inputs, [_tensor(r, inputs, made) for r in refs]


def inline(inputs: list[core.Symbolic], outputs: list[core.Symbolic], new_inputs: list,
           training=None) -> list:
    """The graph from `inputs` to `outputs` called again on `new_inputs` by the same layers (their
    weights are the graph's): a model called as a layer. `training`, when given, is every
    layer call's (Keras's base_model(x, training=False))."""
    made = {id(x): n for x, n in zip(inputs, new_inputs)}

    def again(t):
        return made.get(id(t), t) if isinstance(t, core.Symbolic) else t

    for node in topological(outputs):
        args = [again(t) for t in node.inputs]
        if node.layer is None:
            outs = _listed(core.apply(node.op, *args, **node.attrs))
        else:
            kwargs = {k: again(v) for k, v in node.attrs.get("kwargs", {}).items()}
            outs = _called(node.layer, args, getattr(node.layer, "_dict_keys", None), node.layer.takes_list,
                           node.attrs.get("training") if training is None else training, kwargs)
        for old, new in zip(node.outputs, outs):
            made[id(old)] = new
    return [again(o) for o in outputs]


def _called(layer, args: list, keys, takes_list: bool, training, kwargs: dict) -> list:
    """A layer called on `args` as it was when the graph was traced (a dict by `keys`, a list,
    or one tensor): its outputs as a list."""
    given = dict(zip(keys, args)) if keys is not None else args if takes_list else args[0]
    return _listed(layer(given, training=training, **kwargs))


def _listed(out) -> list:
    """A call's outputs as a list: one tensor, or several (a split; a layer's tuple, list or dict)."""
    out = list(out.values()) if isinstance(out, dict) else out
    return list(out) if isinstance(out, (list, tuple)) else [out]


def topological(outputs: list[core.Symbolic]) -> list[core.Node]:
    """The nodes `outputs` depend on, each after the nodes it reads (iterative: deep graphs)."""
    order, seen, stack = [], set(), [(o.node, False) for o in reversed(outputs)]
    while stack:
        node, done = stack.pop()
        if node is None or (id(node) in seen and not done):
            continue
        if done:
            order.append(node)
            continue
        seen.add(id(node))
        stack.append((node, True))
        reads = list(node.inputs) + list(node.attrs.get("kwargs", {}).values())
        stack.extend((t.node, False) for t in reversed(reads) if isinstance(t, core.Symbolic))
    return order


def _ref(t, refs: dict) -> list:
    if isinstance(t, core.Symbolic):
        if id(t) not in refs:
            raise ConfigError(f"{t} is not one of the model's inputs, nor computed from them")
        return refs[id(t)]
    a = np.asarray(t)
    return ["const", a.tolist(), a.dtype.name]


def _tensor(ref: list, inputs: list, made: list):
    kind = ref[0]
    if kind == "input":
        return inputs[ref[1]]
    if kind == "node":
        return made[ref[1]][ref[2]]
    if kind == "const":
        return np.asarray(ref[1], dtype=ref[2])
    raise ConfigError(f"a graph's config: unknown tensor reference {ref!r}")


def _value(v, refs: dict):
    """A layer call's keyword argument: a tensor by reference, else a JSON value."""
    return {"tensor": _ref(v, refs)} if isinstance(v, (core.Symbolic, np.ndarray)) else _plain(v)


def _unvalue(v, inputs: list, made: list):
    return _tensor(v["tensor"], inputs, made) if isinstance(v, dict) and set(v) == {"tensor"} else _tuples(v)


def _plain(v):
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ConfigError(f"a graph's config: {v!r} ({type(v).__name__}) is not a JSON value")


def _tuples(v):
    """JSON's lists as the tuples ops take (axes, slicing keys, shapes)."""
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    return v


__all__ = ["to_config", "from_config", "inline", "topological"]
