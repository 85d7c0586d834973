"""The inventory: typed views over what Ansible's own loader reads (:mod:`.model`) and the checks
that refuse a bad one before any play runs (:mod:`.check`)."""

from rigctl.inventory.model import (
    FULL_COMMIT,
    HEX_COMMIT,
    INVENTORY_ENV,
    SHA256,
    Gpu,
    Host,
    Inventory,
    LlamaCppPin,
    ServerInstance,
    default_source,
)

__all__ = ["FULL_COMMIT", "HEX_COMMIT", "INVENTORY_ENV", "SHA256", "Gpu", "Host", "Inventory", "LlamaCppPin",
           "ServerInstance", "default_source"]
