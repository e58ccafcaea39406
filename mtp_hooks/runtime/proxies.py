"""What the hooks hand mcore in place of the real objects, for a short span of one forward.

* ``config_view(config, live)``: an instance of the config's own class (a cached subclass) that
  shares the real config's ``__dict__`` and overrides only ``mtp_num_layers``, which reads
  ``None`` while ``live()`` says the forward that installed it is running, so stock mcore's own
  MTP loss stays off. Everything else is the real config: ``isinstance``, ``dataclasses.*``,
  every read and write (writes land in the shared ``__dict__``, i.e. on the real config);
  ``copy``, ``deepcopy`` and ``pickle`` produce the real config's class with its real values.
  ``config_view(config, live, "recompute_granularity")`` is the same for another field: the MTP
  layers of a packed batch run without the full recompute that stock 0.16 - 0.17 cannot do there;
  with ``"defer_embedding_wgrad_compute"`` the dense MTP heads' own output-layer calls and the main
  head's training call stay out of mcore's deferred-wgrad buffers (``features.deferral``).
* ``ForwardOnlyProxy`` (wrapt): the base of the module proxies an option hands an MTP layer for one
  call (``features.detach.DetachedEmbedding``, ``features.chain.DraftEmbedding``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, SupportsIndex

import wrapt

# wrapt >= 2 names the attribute-forwarding proxy ``BaseObjectProxy``; 1.x calls it ``ObjectProxy``.
_ObjectProxy: Any = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)

_VIEW_CLASSES: dict[tuple[type, str], type] = {}


def _view_class(cls: type, field: str) -> type:
    """The view subclass of a config class hiding one field (built once per class and field)."""
    view = _VIEW_CLASSES.get((cls, field))
    if view is not None:
        return view

    def hidden(self: Any) -> Any:
        if self._mtp_hooks_live():
            return None
        return self.__dict__.get(field)

    def set_hidden(self: Any, value: Any) -> None:
        self.__dict__[field] = value

    namespace = {
        "__slots__": ("_mtp_hooks_real", "_mtp_hooks_live"),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        field: property(hidden, set_hidden),
        # ``dataclasses.replace`` builds ``obj.__class__(...)``: an instance of the real class. (Not a
        # ``__class__`` property: ``torch.compile`` resolves attributes through ``__class__`` and would
        # then read ``mtp_num_layers`` from the shared ``__dict__``, where stock's 0.17+ gate sees it.)
        "__new__": staticmethod(lambda view_cls, *args, **kwargs: cls(*args, **kwargs)),
        "__copy__": lambda self: copy.copy(self._mtp_hooks_real),
        "__deepcopy__": lambda self, memo: copy.deepcopy(self._mtp_hooks_real, memo),
        # Pickled as the real config (unpickled through ``copy.copy``, so without this module).
        "__reduce_ex__": lambda self, protocol: (copy.copy, (self._mtp_hooks_real,)),
    }
    view = type(cls.__name__, (cls,), namespace)
    _VIEW_CLASSES[(cls, field)] = view
    return view


def config_view(config: Any, live: Callable[[], bool], field: str = "mtp_num_layers") -> Any:
    """``config`` seen with ``field = None`` while ``live()`` is true (module docstring)."""
    view: Any = object.__new__(_view_class(type(config), field))
    object.__setattr__(view, "__dict__", config.__dict__)
    object.__setattr__(view, "_mtp_hooks_real", config)
    object.__setattr__(view, "_mtp_hooks_live", live)
    return view


def is_config_view(value: Any) -> bool:
    return type(value) in _VIEW_CLASSES.values()


class ForwardOnlyProxy(_ObjectProxy):
    """A proxy that lives inside one forward: copying or pickling it is refused."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        raise TypeError(f"{type(self).__name__} lives for one forward and is not meant to be copied")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(f"{type(self).__name__} lives for one forward and is not meant to be copied")

