"""Make ``import torchvision`` work when its compiled operators cannot load.

The fix lives in the top-level module ``_merak_torchvision`` (shipped with merak), because it must
also run at interpreter start, before anything imports torchvision and without importing merak:
see that module for the reason and the mechanism. ``import merak`` calls
:func:`ensure_torchvision_importable` as well, for environments without the start-up hook.
"""

import importlib.util
import sys
from pathlib import Path

try:
    from _merak_torchvision import ensure_torchvision_importable, nms_reference
except ModuleNotFoundError:
    # An editable install made before the module existed does not know it (until `make setup` runs
    # again): take it from the checkout this package is in, so that `import merak` keeps working.
    _spec = importlib.util.spec_from_file_location(
        "_merak_torchvision", Path(__file__).resolve().parents[2] / "_merak_torchvision.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["_merak_torchvision"] = _module
    _spec.loader.exec_module(_module)
    ensure_torchvision_importable, nms_reference = _module.ensure_torchvision_importable, _module.nms_reference

__all__ = ["ensure_torchvision_importable", "nms_reference"]
