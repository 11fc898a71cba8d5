"""Make the checkout's developer tools runnable from its virtualenv (`make` runs this).

The product wheel carries only `extproc` and `controller`. The developer tools (`bench`: the
simulator, the local stack, the benchmarks) stay in the checkout: a `.pth` file puts the checkout
on the virtualenv's path, and `kvroute-dev` is a launcher of `bench.cli` next to its Python.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    if sys.prefix == sys.base_prefix:
        raise SystemExit("run this with the checkout's virtualenv Python (make does)")
    site = Path(sysconfig.get_paths()["purelib"])
    (site / "kvroute-checkout.pth").write_text(f"{ROOT}\n")
    launcher = Path(sys.executable).parent / "kvroute-dev"
    launcher.write_text(f"#!{sys.executable}\nfrom bench.cli import main\n\nmain()\n")
    launcher.chmod(0o755)


if __name__ == "__main__":
    main()
