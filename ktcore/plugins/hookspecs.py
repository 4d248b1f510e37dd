"""The four plugin hooks. Each returns a list of descriptors (ktcore.specs) and does no other work."""

import pluggy

hookspec = pluggy.HookspecMarker("ktcore")


@hookspec
def ktcore_register_expert_backends():
    """Return a list of ExpertBackendSpec."""


@hookspec
def ktcore_register_archs():
    """Return a list of ArchSpec."""


@hookspec
def ktcore_register_frontends():
    """Return a list of FrontendSpec."""


@hookspec
def ktcore_register_adapter_formats():
    """Return a list of AdapterFormatSpec."""


# hook name -> plugin kind (the key of ktcore.specs.SPEC_TYPES)
HOOK_KINDS = {
    "ktcore_register_expert_backends": "expert_backend",
    "ktcore_register_archs": "arch",
    "ktcore_register_frontends": "frontend",
    "ktcore_register_adapter_formats": "adapter_format",
}
