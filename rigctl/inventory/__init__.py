"""The inventory: typed views over what Ansible's own loader reads (:mod:`.model`), the one resolver of
llama_server profiles and instance plans that the role shares (:mod:`.profiles`), the schema of every variable
rigctl reads (:mod:`.schema`, with the shapes of :mod:`.keys`) and the checks that refuse a bad inventory before
any play runs (:mod:`.check`).

The views are imported from :mod:`.model` when first asked for, so that :mod:`.preload` can fork its
child before this process has imported YAML and the model (``rigctl``'s entry point does)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rigctl.inventory.model import (
        INVENTORY_ENV,
        Artifact,
        Gpu,
        Host,
        Inventory,
        LlamaCppPin,
        Profile,
        Server,
        default_source,
    )

__all__ = ["INVENTORY_ENV", "Artifact", "Gpu", "Host", "Inventory", "LlamaCppPin", "Profile", "Server",
           "default_source"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rigctl.inventory import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
