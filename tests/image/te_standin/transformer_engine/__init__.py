"""CPU stand-in for ``transformer_engine``: names only; building or calling anything raises.

Megatron-Bridge at the pin imports Transformer Engine on the ``import megatron.bridge`` path
(``megatron/bridge/peft/lora_layers.py``: ``import transformer_engine.pytorch as te``), and TE
needs CUDA. ``tests/image/bridge_probe.py`` puts this folder first on ``sys.path`` only in its
own subprocess, only when the real TE is absent (the cpu image), so that the gate can import
Bridge and build configs on CPU; every other test, and any image with TE, never sees it.

Every ``transformer_engine.*`` module exists and every attribute is a class (an
``nn.Module`` subclass, so registries that check the base class accept it); instantiating one
raises ``RuntimeError``. The version (dist-info next to this folder) is ``2.10.0+cpustandin``.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import torch

__version__ = "2.10.0+cpustandin"
__path__ = []  # a package: submodules come from the finder below


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_StandIn,), {"__module__": cls.__module__})
        setattr(cls, name, value)
        return value


class _StandIn(torch.nn.Module, metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is the CPU stand-in of "
                           "Transformer Engine, which needs CUDA")


def _module_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_StandIn,), {"__module__": modname})
        setattr(sys.modules[modname], name, value)
        return value

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``transformer_engine.*`` (and ``transformer_engine_torch``) a stand-in module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("transformer_engine.") or fullname == "transformer_engine_torch":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
