"""Build llama.cpp's tools (CPU only) from the llama.cpp that the llama-cpp-python sdist vendors,
cached outside the repository.

    python bench/llamacpp.py build                      # prints the bin dir (llama-tokenize)
    python bench/llamacpp.py build --target llama-bench --target llama-server
    python bench/llamacpp.py build --sdist /path/to/llama_cpp_python-0.3.36.tar.gz
    nice -n 19 python bench/llamacpp.py build --native --target llama-bench --target llama-server
    python bench/llamacpp.py tokenize MODEL.gguf CASES.json   # CASES.json with llama-tokenize's ids

Layout: ``<cache>/llama.cpp/<version>/`` holds the sdist (fetched with ``pip download``, so pip's
own HTTP cache serves a second fetch), ``src/`` (its ``vendor/llama.cpp`` tree, extracted once)
and ``build/`` (cmake's tree, reused: building another target later compiles only what it adds).
``--native`` uses ``build-native/`` instead, configured with ``-DGGML_NATIVE=ON`` (``-march=native``:
this machine's best SIMD, e.g. AVX-512 + VNNI, for a peer-at-its-best speed comparison; the binaries
only run on CPUs like this one, so CI never builds it).
``<cache>`` is ``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else
``~/.cache/mlx-serving``. ``<version>`` is the llama-cpp-python version; 0.3.36 vendors
ggml-org/llama.cpp@0c1e57098 (its CHANGELOG.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098"  # vendored by LLAMA_CPP_PYTHON_VERSION (its CHANGELOG.md)
DEFAULT_TARGETS = ("llama-tokenize",)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
)


def cache_root() -> Path:
    """``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``."""
    if os.environ.get("MLX_SERVING_CACHE"):
        return Path(os.environ["MLX_SERVING_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-serving"


def version_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / "llama.cpp" / version


def sdist(version: str = LLAMA_CPP_PYTHON_VERSION, *, seed: Path | None = None) -> Path:
    """The llama-cpp-python sdist in the cache: copied from ``seed`` when given, else fetched with
    ``pip download --no-deps --no-binary :all:`` (about 76 MB). Raises CalledProcessError when pip
    fails (no registry)."""
    name = f"llama_cpp_python-{version}.tar.gz"
    target = version_dir(version) / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if seed is not None:
        shutil.copyfile(seed, target)
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        os.replace(Path(tmp) / name, target)
    return target


def source_dir(archive: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``vendor/llama.cpp`` of the sdist, extracted once into ``<version dir>/src`` (written to a
    temporary sibling and renamed, so the path only ever holds a complete tree)."""
    target = version_dir(version) / "src"
    if (target / "CMakeLists.txt").is_file():
        return target
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, tarfile.open(archive) as tar:
        # its .git file points at the sdist's absent git dir (cmake's build-info would complain)
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name != prefix + ".git"]
        tar.extractall(tmp, members=members, filter="data")
        os.replace(Path(tmp) / prefix, target)
    return target


def build(targets: Sequence[str] = DEFAULT_TARGETS, version: str = LLAMA_CPP_PYTHON_VERSION, *,
          seed: Path | None = None, jobs: int = 2, native: bool = False) -> Path:
    """Build ``targets`` (cmake target names, e.g. ``llama-tokenize``, ``llama-bench``,
    ``llama-server``) CPU-only and return the bin dir. Targets already built are not rebuilt
    (cmake decides); the first llama-tokenize build takes a few minutes on 2 cores. ``native``
    builds in ``build-native/`` with ``-DGGML_NATIVE=ON`` (this CPU's instruction set), else in
    ``build/`` with ``-DGGML_NATIVE=OFF`` (portable)."""
    src = source_dir(sdist(version, seed=seed), version)
    build_dir = version_dir(version) / ("build-native" if native else "build")
    if not (build_dir / "CMakeCache.txt").is_file():
        subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_OPTIONS,
                        f"-DGGML_NATIVE={'ON' if native else 'OFF'}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets], check=True,
                   stdout=subprocess.DEVNULL)
    return build_dir / "bin"


def tokenize(model: Path, text: str, *, parse_special: bool, bin_dir: Path | None = None) -> list[int]:
    """Ids of ``text`` by ``llama-tokenize`` (built first if needed): the text on stdin, taken
    verbatim (``--no-escape``), no BOS (``--no-bos``), special-token strings parsed only with
    ``parse_special`` (else ``--no-parse-special``, which is llama.cpp's ``parse_special=false``)."""
    exe = (bin_dir or build(("llama-tokenize",))) / "llama-tokenize"
    flags = ["--stdin", "--ids", "--no-bos", "--no-escape", "--log-disable"]
    if not parse_special:
        flags.append("--no-parse-special")
    out = subprocess.run([str(exe), "-m", str(model), *flags], input=text.encode(), capture_output=True, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def tokenize_cases(model: Path, cases_path: Path) -> dict[str, object]:
    """The JSON object of ``cases_path`` with each ``cases[i]`` given ``ids`` (special strings as
    text) and ``ids_parse_special`` (special strings as control tokens) from llama-tokenize."""
    data = json.loads(cases_path.read_text(encoding="utf-8"))
    data["llama_cpp"] = (f"ggml-org/llama.cpp@{LLAMA_CPP_COMMIT}, as vendored by the llama-cpp-python "
                         f"{LLAMA_CPP_PYTHON_VERSION} sdist, built CPU-only with bench/llamacpp.py")
    bin_dir = build(("llama-tokenize",))
    for case in data["cases"]:
        case["ids"] = tokenize(model, case["text"], parse_special=False, bin_dir=bin_dir)
        case["ids_parse_special"] = tokenize(model, case["text"], parse_special=True, bin_dir=bin_dir)
    return data


def _dump(data: dict[str, object]) -> str:
    """JSON with one line per case (ids lists stay on their line)."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = ",\n".join(json.dumps(case, ensure_ascii=False) for case in data["cases"])  # type: ignore[attr-defined]
    return json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ',\n "cases": [\n' + lines + "\n ]\n}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("build", help="build targets; print the bin dir")
    cmd.add_argument("--target", action="append", help=f"cmake target (repeatable; default {DEFAULT_TARGETS[0]})")
    cmd.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python version")
    cmd.add_argument("--sdist", type=Path, help="an already downloaded sdist to seed the cache with")
    cmd.add_argument("-j", "--jobs", type=int, default=2)
    cmd.add_argument("--native", action="store_true", help="build-native/ with -DGGML_NATIVE=ON")
    cmd = sub.add_parser("tokenize", help="fill a cases JSON file's ids with llama-tokenize's; print it")
    cmd.add_argument("model", type=Path, help="a .gguf file")
    cmd.add_argument("cases", type=Path, help='JSON object with "cases": [{"text": ...}, ...]')
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.target or DEFAULT_TARGETS, args.version, seed=args.sdist, jobs=args.jobs,
                    native=args.native))
    else:
        print(_dump(tokenize_cases(args.model, args.cases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
