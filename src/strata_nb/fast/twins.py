"""Which fast launcher stands in for which plain one.

The engine names an op by its two functions, the reference and the plain launcher
(`be.op(argmax_ref, argmax)`): the numpy backend runs the reference, the plain cuda
backend the plain launcher, and the fast backend the fast twin registered here for that
launcher, or the plain launcher where the fast tier has none. tests/test_twins.py holds that
every registered pair has a test that runs both on the same inputs and holds them equal.

Many fast kernels are a plain kernel launched as dependent (dependent_launch.py): the
same code with the wait for the kernel before it at its first instruction. Such a twin
calls the plain kernel's code as a device function (`inline_body`); NVVM inlines it, so
the twin's PTX is the plain kernel's plus the two instructions. Its launcher is the plain
launcher's code with the twin in the plain kernel's place (`relaunch`): the same checks,
grid and arguments, written once.
"""
from __future__ import annotations

import sys
import types

from strata_nb.gpu.launch import inline_device

# --8<-- [start:twin_registry]
TWINS: dict = {}  # plain launcher -> its fast twin


def twin_of(plain_launcher):
    """Register the decorated fast launcher as `plain_launcher`'s twin."""
    def register(fast_launcher):
        TWINS[plain_launcher] = fast_launcher
        fast_launcher.plain_twin = plain_launcher
        return fast_launcher
    return register


def load_twins():
    """Import every module of the fast tier, so each has registered its twins."""
    import importlib
    import pkgutil

    import strata_nb.fast as fast

    for module in pkgutil.iter_modules(fast.__path__):
        importlib.import_module(f"strata_nb.fast.{module.name}")


def fast_or_plain(launcher):
    """The twin registered for `launcher`, else `launcher` itself."""
    return TWINS.get(launcher, launcher)


def inline_body(kernel):
    """A plain @cuda.jit kernel's code as a device function, inlined into whatever calls it."""
    return inline_device(kernel.py_func)


def relaunch(launcher, **kernels):
    """`launcher`'s code with `kernels` (name=kernel) in place of the globals of those
    names: the plain launcher launching fast kernels."""
    names = dict(launcher.__globals__)
    missing = set(kernels) - set(names)
    assert not missing, f"{launcher.__name__} launches no global named {sorted(missing)}"
    names.update(kernels)
    fast = types.FunctionType(launcher.__code__, names, launcher.__name__, launcher.__defaults__,
                              launcher.__closure__)
    fast.__kwdefaults__ = launcher.__kwdefaults__
    fast.__module__ = sys._getframe(1).f_globals.get("__name__", launcher.__module__)  # the fast module that made it
    fast.__doc__ = f"{launcher.__module__}.{launcher.__name__}, launching {', '.join(kernels)} of the fast tier."
    return fast
# --8<-- [end:twin_registry]
