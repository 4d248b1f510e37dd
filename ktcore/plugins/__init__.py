"""Plugin manager: entry-point discovery, safe loading, conflicts and records.

Every plugin, built-in or third-party, is a module named by an entry point in the ``ktcore`` group. Loading
one never breaks the others: a module that fails to import, or whose hooks fail, is recorded as *broken*
with its exception and warned about once. ``KTCORE_STRICT_PLUGINS=1`` re-raises instead (CI sets it).

Environment:
  KTCORE_LOAD_PLUGINS     comma list: load only these third-party plugins (entry point or distribution
                          names); ktcore's own built-ins always load
  KTCORE_DISABLE_PLUGINS  comma list: never load these (built-ins included)
  KTCORE_STRICT_PLUGINS   1: a broken plugin is an error
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Iterable, Optional

import pluggy

from ..errors import PluginError
from ..specs import SPEC_TYPES
from . import hookspecs

ENTRY_POINT_GROUP = "ktcore"
BUILTIN_DIST = "ktcore"

_warned: set[str] = set()


class PluginWarning(UserWarning):
    """A plugin could not be loaded; the others keep working."""


class PluginConflictError(PluginError):
    pass


class UnknownPluginError(PluginError, KeyError):
    def __str__(self):  # KeyError would quote the message
        return self.args[0]


@dataclass(frozen=True)
class PluginRecord:
    """One row of ``ktcore plugins``: a descriptor a plugin registered, or a plugin that failed."""

    name: str
    kind: str  # expert_backend | arch | frontend | adapter_format | module (a plugin that failed whole)
    entry_point: str
    dist: str
    version: str
    status: str  # ok | broken | disabled
    reason: str = ""
    spec: object = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "spec"}


def _env_list(name: str) -> Optional[set[str]]:
    value = os.environ.get(name)
    if value is None:
        return None
    return {item.strip() for item in value.split(",") if item.strip()}


def _strict_default() -> bool:
    return os.environ.get("KTCORE_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes")


def discover_entry_points() -> list[metadata.EntryPoint]:
    seen, found = set(), []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        key = (metadata.Prepared.normalize(dist), ep.name)
        if key not in seen:  # the same distribution can be visible on sys.path twice
            seen.add(key)
            found.append(ep)
    return found


class Registry:
    """The loaded plugins. ``ktcore.plugins.get_registry()`` holds the process-wide one."""

    def __init__(
        self,
        entry_points: Optional[Iterable[metadata.EntryPoint]] = None,
        *,
        strict: Optional[bool] = None,
        allow: Optional[set[str]] = None,
        deny: Optional[set[str]] = None,
    ):
        self.strict = _strict_default() if strict is None else strict
        self.allow = _env_list("KTCORE_LOAD_PLUGINS") if allow is None else allow
        self.deny = (_env_list("KTCORE_DISABLE_PLUGINS") or set()) if deny is None else deny
        self.manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.manager.add_hookspecs(hookspecs)
        self._records: list[PluginRecord] = []
        for ep in discover_entry_points() if entry_points is None else entry_points:
            self._load(ep)
        self._check_conflicts()

    # -- loading ---------------------------------------------------------------------------------------
    def _load(self, ep: metadata.EntryPoint) -> None:
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        row = dict(entry_point=ep.name, dist=dist, version=version)
        names = {ep.name, dist}
        if names & self.deny:
            self._records.append(PluginRecord(ep.name, "module", status="disabled",
                                              reason="listed in KTCORE_DISABLE_PLUGINS", **row))
            return
        if self.allow is not None and dist != BUILTIN_DIST and not names & self.allow:
            self._records.append(PluginRecord(ep.name, "module", status="disabled",
                                              reason="not listed in KTCORE_LOAD_PLUGINS", **row))
            return
        try:
            module = ep.load()
            self.manager.register(module, name=f"{dist}:{ep.name}")
            self._check_hook_names(module)
        except Exception as exc:  # noqa: BLE001 - any failure of third-party code is recorded
            self._broken(ep.name, "module", row, exc)
            return
        for hook_name, kind in hookspecs.HOOK_KINDS.items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                if impl.plugin is module:
                    self._collect(impl.function, hook_name, kind, row)

    def _check_hook_names(self, module) -> None:
        """A hookimpl no spec knows (a misspelled hook) would silently register nothing: reject the module."""
        unknown = sorted(name for name, caller in vars(self.manager.hook).items()
                         if not name.startswith("_") and not caller.has_spec()
                         and any(impl.plugin is module for impl in caller.get_hookimpls()))
        if unknown:
            self.manager.unregister(module)
            raise pluggy.PluginValidationError(
                module, f"unknown hook {', '.join(unknown)}; ktcore's hooks are {', '.join(hookspecs.HOOK_KINDS)}")

    def _collect(self, hook, hook_name: str, kind: str, row: dict) -> None:
        try:
            specs = hook()
            if specs is None:
                specs = []
            specs = list(specs)
            for spec in specs:
                if not isinstance(spec, SPEC_TYPES[kind]):
                    raise TypeError(f"{hook_name} returned {type(spec).__name__}, "
                                    f"expected {SPEC_TYPES[kind].__name__}")
        except Exception as exc:  # noqa: BLE001
            self._broken(f"{row['entry_point']}.{hook_name}", kind, row, exc)
            return
        for spec in specs:
            self._records.append(PluginRecord(spec.name, kind, status="ok", spec=spec, **row))

    def _broken(self, name: str, kind: str, row: dict, exc: BaseException) -> None:
        # one line: the reason goes into tables and one-line errors (pluggy's messages span several lines)
        reason = f"{type(exc).__name__}: " + "; ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
        if self.strict:
            raise PluginError(f"plugin {row['entry_point']!r} from {row['dist']} {row['version']} failed to "
                              f"load: {reason} (unset KTCORE_STRICT_PLUGINS to skip it)") from exc
        self._records.append(PluginRecord(name, kind, status="broken", reason=reason, **row))
        key = f"{row['dist']}:{name}:{reason}"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"ktcore plugin {row['entry_point']!r} from {row['dist']} is broken and skipped: "
                          f"{reason}", PluginWarning, stacklevel=3)

    def _check_conflicts(self) -> None:
        owners: dict[tuple[str, str], PluginRecord] = {}
        for rec in self._records:
            if rec.status != "ok":
                continue
            other = owners.setdefault((rec.kind, rec.name), rec)
            if other is not rec:
                raise PluginConflictError(
                    f"two plugins register the {rec.kind} {rec.name!r}: {other.dist} {other.version} (entry point "
                    f"{other.entry_point!r}) and {rec.dist} {rec.version} (entry point {rec.entry_point!r}); "
                    f"uninstall one, or disable one with KTCORE_DISABLE_PLUGINS={rec.entry_point}")

    # -- queries ---------------------------------------------------------------------------------------
    def records(self, kind: Optional[str] = None, *, include_inactive: bool = True) -> list[PluginRecord]:
        """Rows of ``kind`` (all kinds when None); failed and disabled plugin modules show under every kind."""
        return [r for r in self._records
                if (kind is None or r.kind in (kind, "module"))
                and (include_inactive or r.status == "ok")]

    def specs(self, kind: str) -> dict[str, object]:
        return {r.name: r.spec for r in self._records if r.kind == kind and r.status == "ok"}

    def get(self, kind: str, name: str, unavailable: Optional[dict[str, str]] = None):
        """The descriptor ``name`` of ``kind``, or an error listing what exists and why the rest do not.

        ``unavailable`` maps names that are registered but unusable here to their reasons.
        """
        specs = self.specs(kind)
        unavailable = unavailable or {}
        if name in specs and name not in unavailable:
            return specs[name]
        label = kind.replace("_", " ")
        usable = sorted(n for n in specs if n not in unavailable)
        lines = [f"{label} {name!r} is not available."]
        if name in unavailable:
            lines = [f"{label} {name!r} is installed but cannot be used here: {unavailable[name]}."]
        lines.append(f"Choose one of: {', '.join(usable) or '(none)'}.")
        for n, why in sorted(unavailable.items()):
            if n != name:
                lines.append(f"  {n}: unavailable ({why})")
        for rec in self._records:
            if rec.status != "ok" and rec.kind in (kind, "module"):
                lines.append(f"  {rec.entry_point} ({rec.dist}): {rec.status} ({rec.reason})")
        raise UnknownPluginError("\n".join(lines))


_registry: Optional[Registry] = None


def get_registry() -> Registry:
    global _registry
    if _registry is None:
        _registry = Registry()
    return _registry


def reset_registry() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin in-process)."""
    global _registry
    _registry = None


def list_plugins(kind: Optional[str] = None) -> list[PluginRecord]:
    return get_registry().records(kind)
