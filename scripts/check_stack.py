"""Is this interpreter's environment the pinned default stack? Exit 0 if so, 1 (saying what differs) if not.

The stack is what the README's pip path installs: torch (first, from the CPU wheel index unless told
otherwise), then ``pip install -e ".[test]" -c requirements/py311.txt``. Checked: every dependency and
``[test]`` package that ``requirements/py311.txt`` pins is installed at its pinned version (a local
label such as ``+cpu`` allowed), no ``nvidia-*`` CUDA wheel came along unless ``--allow-cuda``, and
``mtp_hooks`` is this checkout's, installed editable. ``make venv`` runs it before building, so a
virtualenv the pip path made is kept as it is; ``scripts/check_install.sh`` runs it after its install.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pins(path: pathlib.Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            found[name.strip().lower()] = version.strip()
    return found


def wanted() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    return [re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in requirements]


def problems(requirements: pathlib.Path, allow_cuda: bool) -> list[str]:
    pinned = pins(requirements)
    found: list[str] = []
    for name in wanted():
        if name not in pinned:
            continue
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            found.append(f"{name}: not installed (pinned {pinned[name]})")
            continue
        if version.split("+")[0] != pinned[name]:
            found.append(f"{name}: {version} installed, {pinned[name]} pinned")
    if not allow_cuda:
        cuda = sorted(d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].lower().startswith("nvidia-"))
        if cuda:
            found.append(f"CUDA wheels installed: {cuda[:4]}{' ...' if len(cuda) > 4 else ''}")
    try:
        import mtp_hooks
    except ImportError as error:
        found.append(f"mtp_hooks: does not import ({error})")
    else:
        if not pathlib.Path(mtp_hooks.__file__).resolve().is_relative_to(ROOT):
            found.append(f"mtp_hooks: imported from {mtp_hooks.__file__}, not this checkout")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirements", type=pathlib.Path, default=ROOT / "requirements" / "py311.txt")
    parser.add_argument("--allow-cuda", action="store_true", help="a CUDA build of torch is fine (a GPU machine's)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    found = problems(args.requirements, args.allow_cuda)
    if found:
        print("the environment is not the pinned stack:\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    if not args.quiet:
        import megatron.core
        import torch

        import mtp_hooks

        print(f"stack ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, mtp_hooks {mtp_hooks.__version__} from {mtp_hooks.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
