"""The step's lowered program kept on disk, so that a warm start neither traces nor lowers.

JAX's persistent compilation cache skips XLA's compilation on a restart, but a
jitted call still traces the Python model and lowers it to StableHLO to find
its cache key: for a 32-layer model that is seconds per token bucket, most of
a warm start's precompile. This cache keeps the lowered program itself
(`jax.export`, serialized StableHLO over the flattened arguments), keyed by
everything the trace depends on; a warm start deserializes it, and XLA's
persistent cache then supplies the executable. (Serializing the executable
itself would skip one more step, but an executable that XLA:CPU loaded from its
own cache re-serializes without its kernels.)

The key. The program is a function of: jaxllm's and the kernels' source (a
hash of every .py file in both packages), the jax/jaxlib versions, the XLA
flags, the devices (platform, kind, ids), the caller's context (model config,
dtype, attention backend, mesh), the function's name, and the abstract values
and shardings of its arguments (shapes, dtypes, pytree structure). A change in
any of them is a different file. A file that fails to load is traced again and
overwritten.

Set `JAXLLM_AOT_CACHE=0` to turn it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
from typing import Any

import jax
import numpy as np

from jaxllm.config_cache import code_fingerprint

logger = logging.getLogger(__name__)


def _describe_args(args: tuple) -> str:
    """Abstract values, shardings and pytree structure of `args`, as text."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        weak = getattr(x, "weak_type", False)
        parts.append(f"{getattr(x, 'shape', ())}|{getattr(x, 'dtype', type(x).__name__)}|"
                     f"{weak}|{sharding}")
    return "\n".join(parts)


class ExecutableCache:
    """`load_or_compile(name, fn, args)` -> `fn` compiled for `args`' shapes."""

    def __init__(self, directory: str, context: dict[str, Any], devices: list[Any]):
        self.directory = directory
        self.devices = devices
        import jaxlib

        ident = {
            "code": code_fingerprint(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "devices": [(d.platform, d.device_kind, d.id) for d in devices],
            "context": context,
        }
        self._prefix = hashlib.sha256(
            json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
        self.loaded = 0
        self.traced = 0
        self.failed = 0
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def create(cls, xla_cache_dir: str, context: dict[str, Any],
               devices: list[Any]) -> ExecutableCache | None:
        # Nor in a multi-host job: its processes (on one machine, one directory) would
        # share files while each must load a program made for its own devices.
        if os.environ.get("JAXLLM_AOT_CACHE", "1") == "0" or jax.process_count() > 1:
            return None
        return cls(os.path.join(xla_cache_dir, "jaxllm-aot"), context, devices)

    def path(self, name: str, args: tuple) -> str:
        key = hashlib.sha256(f"{self._prefix}\n{name}\n{_describe_args(args)}".encode())
        return os.path.join(self.directory, f"{name}-{key.hexdigest()[:40]}.jaxexe")

    def load_or_compile(self, name: str, fn: Any, args: tuple,
                        donate_argnums: tuple[int, ...] = (),
                        compiler_options: dict[str, Any] | None = None
                        ) -> AotFunction | None:
        """`fn(*args)` compiled for these argument shapes with XLA's `compiler_options`;
        `fn` is traced only on a miss. None when the program cannot be exported (the
        caller then compiles `fn` itself)."""
        from jax import export

        leaves, in_tree = jax.tree_util.tree_flatten(args)
        # Flat positions of the donated arguments' leaves.
        bounds = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
        donated = tuple(i for a in donate_argnums for i in range(bounds[a], bounds[a + 1]))
        path = self.path(name, args)
        # The same program compiled with other options is another executable.
        key = path + json.dumps(compiler_options or {}, sort_keys=True)
        if key in _compiled:  # another engine of this process already has it
            self.loaded += 1
            return _compiled[key]
        exported = out_tree = None
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    blob, out_tree = pickle.load(f)
                exported = export.deserialize(blob)
                self.loaded += 1
            except Exception as e:  # a stale or damaged file: trace it again
                logger.warning("could not load the cached program %s (%s: %s); tracing",
                               path, type(e).__name__, e)
                exported = None
        if exported is None:
            tree_box: list[Any] = []

            def flat_fn(*flat):
                out_leaves, tree = jax.tree_util.tree_flatten(fn(*in_tree.unflatten(flat)))
                tree_box.append(tree)
                return out_leaves

            specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                          sharding=getattr(x, "sharding", None))
                     for x in leaves]
            # The file is keyed by these exact versions, so custom calls without
            # a cross-version stability promise (Triton kernels) are fine.
            try:
                # For the cache's devices, which need not be this process's default
                # backend (a TPU slice compiled for on another host, tpu_compile.py).
                exported = export.export(
                    jax.jit(flat_fn, donate_argnums=donated),
                    platforms=_export_platforms(self.devices[0].platform),
                    disabled_checks=[export.DisabledSafetyCheck.custom_call("ALL")])(*specs)
            except Exception as e:  # this program cannot be exported: plain jit it is
                logger.warning("cannot export %s for the program cache (%s: %s); it will be "
                               "traced on every start", name, type(e).__name__, e)
                self.failed += 1
                return None
            out_tree = tree_box[0]
            self.traced += 1
            try:
                blob = pickle.dumps((exported.serialize(), out_tree),
                                    protocol=pickle.HIGHEST_PROTOCOL)
                fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)  # atomic: concurrent starts never read half a file
            except Exception as e:  # still usable, just not cached
                logger.warning("could not store the program for %s (%s: %s)", name,
                               type(e).__name__, e)
        compiled = jax.jit(exported.call, donate_argnums=donated).lower(*leaves).compile(
            compiler_options=compiler_options or None)
        _compiled[key] = AotFunction(compiled, in_tree, out_tree)
        return _compiled[key]


# Compiled programs of this process by file: engines built on the same model share them.
_compiled: dict[str, AotFunction] = {}


def clear_compiled() -> None:
    """Forgets this process's compiled programs (a live engine keeps its own references).
    `jax.clear_caches` does not reach them, and each holds its executable's memory."""
    _compiled.clear()


class AotFunction:
    """Calls a compiled flat program with the original pytree arguments."""

    def __init__(self, compiled: Any, in_tree: Any, out_tree: Any):
        self.compiled = compiled
        self.in_tree = in_tree
        self.out_tree = out_tree

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"argument structure changed: {tree} != {self.in_tree}")
        return self.out_tree.unflatten(self.compiled(*leaves))


def _export_platforms(platform: str) -> list[str] | None:
    """The platforms to export for: the default backend's own (None) unless the devices
    are another backend's (compile-only TPU devices on a CPU host). A GPU device says
    'gpu' where export wants 'cuda' or 'rocm', so the default is never named."""
    return None if platform == jax.default_backend() else [platform]
