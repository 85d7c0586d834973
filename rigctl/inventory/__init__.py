"""The inventory: typed views over what Ansible's own loader reads (:mod:`.model`), the one resolver of
llama_server profiles and instance plans that the role shares (:mod:`.profiles`) and the checks that
refuse a bad inventory before any play runs (:mod:`.check`)."""

from rigctl.inventory.model import (
    FULL_COMMIT,
    HEX_COMMIT,
    INVENTORY_ENV,
    SHA256,
    Artifact,
    Gpu,
    Host,
    Inventory,
    LlamaCppPin,
    Profile,
    Server,
    default_source,
)

__all__ = ["FULL_COMMIT", "HEX_COMMIT", "INVENTORY_ENV", "SHA256", "Artifact", "Gpu", "Host", "Inventory",
           "LlamaCppPin", "Profile", "Server", "default_source"]
