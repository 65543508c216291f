"""Rules every kernel of `dlmc.custom_ops` keeps for `_registration.traced_triton_op`."""

import dis
import importlib
import pkgutil
import types

import dlmc.custom_ops as package


def _jit_functions():
    """(module, name, Python function) of every `triton.jit` function defined in the package
    (compiled or, under the CPU interpreter, interpreted)."""
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
                yield module.__name__, name, fn


def test_kernels_call_jit_functions_by_plain_name():
    """Inductor rebuilds a traced kernel's source from the plain names it loads (JIT functions,
    constants, triton's modules); `module.function` inside a kernel compiled on CPU and in
    eager CUDA launches, and failed only when Inductor compiled the round on the H200
    (`NameError`). So no kernel loads a module other than triton's."""
    functions = list(_jit_functions())
    assert len(functions) > 50  # the package's kernels and device functions were found
    bad = [(module, name, load) for module, name, fn in functions
           for load in {i.argval for i in dis.Bytecode(fn) if i.opname == "LOAD_GLOBAL"}
           if isinstance(fn.__globals__.get(load), types.ModuleType)
           and not fn.__globals__[load].__name__.startswith("triton")]
    assert bad == []
