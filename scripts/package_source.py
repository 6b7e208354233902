"""Training code from installed packages: a seeded pick of each package's Python source.

Head v6 of the built-in model was fine-tuned on this beside the trunk's answers and the
standard library, so that it drafts human-written library code as well as chat. The packages
are ones an mtpkit install brings, so anyone can pick the same files; ``OUT.json`` (beside
the folder, where calibrate does not read it as text) records each package's version, bytes
and file count. ``starlette`` is left out on purpose: it is the unseen package the head's
acceptance is measured on.

Files of 2-150 KB, test and vendored folders excluded, shuffled with the seed, taken until a
package passes ``--cap`` bytes; copied under ``OUT/<package>/...`` with their own paths.

    python scripts/package_source.py --out pkgs
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import random
import shutil
import sysconfig
from pathlib import Path

# import name -> distribution name
PACKAGES = {
    "torch": "torch", "transformers": "transformers", "numpy": "numpy", "rich": "rich",
    "jinja2": "Jinja2", "fastapi": "fastapi", "pydantic": "pydantic", "uvicorn": "uvicorn",
    "gguf": "gguf", "compressed_tensors": "compressed-tensors",
    "huggingface_hub": "huggingface-hub", "sympy": "sympy", "networkx": "networkx",
    "matplotlib": "matplotlib", "httpx": "httpx", "openai": "openai", "_pytest": "pytest",
    "anyio": "anyio", "click": "click", "filelock": "filelock", "fsspec": "fsspec",
    "safetensors": "safetensors", "tokenizers": "tokenizers",
}
SKIP_DIRS = {"_vendor", "vendored", "_vendored", "testing"}


def pick(site: Path, package: str, cap: int, seed: int) -> list[Path]:
    """The package's files this pick takes, in the order it takes them."""
    files = sorted(
        f for f in (site / package).rglob("*.py")
        if not any(p.startswith("test") or p in SKIP_DIRS for p in f.relative_to(site).parts)
        and 2_000 <= f.stat().st_size <= 150_000
    )
    random.Random(seed).shuffle(files)
    took, total = [], 0
    for f in files:
        if total >= cap:
            break
        took.append(f)
        total += f.stat().st_size
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="new folder for the copies")
    ap.add_argument("--cap", type=int, default=450_000, help="bytes per package (default 450000)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    site, out = Path(sysconfig.get_paths()["purelib"]), Path(a.out)
    if out.exists():
        raise SystemExit(f"{out} exists; give a new folder")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    record = {}
    for package, dist in PACKAGES.items():
        if not (site / package).is_dir():
            raise SystemExit(f"{package} is not installed in {site}: pip install {dist}")
        took = pick(site, package, a.cap, a.seed)
        for f in took:
            dst = tmp / f.relative_to(site)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
        record[package] = {"version": md.version(dist), "files": len(took),
                           "bytes": sum(f.stat().st_size for f in took)}
    tmp.rename(out)
    out.with_name(out.name + ".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{sum(r['files'] for r in record.values())} files, "
          f"{sum(r['bytes'] for r in record.values()):,} bytes in {out}")


if __name__ == "__main__":
    main()
