"""The JavaScript of the decks (and the site's MathJax), served from slides/vendor/ so that they
work with no network: reveal.js 4, require.js and MathJax 2 (what nbconvert's reveal template
expects), from the npm registry at pinned versions checked by SHA-256. `make slides` and
`make site` run it; a package already there is not fetched again.

    python slides/vendor.py slides/vendor
"""
import hashlib
import io
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

REGISTRY = "https://registry.npmjs.org"
# name, version, sha256 of the tarball, what to keep (paths inside the tarball's package/)
PACKAGES = [
    ("reveal.js", "4.6.1", "4f4121ef2b8e7e9398bdecd7b3b6ce5e0ee3a2f5af221708eb6c4ce03bcae6be",
     ("dist/", "plugin/notes/")),
    ("requirejs", "2.3.7", "31f3330c978fb28684622fe71165dc946432cf0210b2ea8a1ca0233e70f2737d",
     ("require.js",)),
    ("mathjax", "2.7.9", "7131e739848edc14aa661a5516995866b81a477fab8b039d7cc324930e71f786",
     ("MathJax.js", "config/TeX-AMS_CHTML-full.js", "config/Safe.js",
      "extensions/", "jax/input/TeX/",
      "jax/output/CommonHTML/", "jax/element/", "fonts/HTML-CSS/TeX/woff/", "localization/en/")),
]


def fetch(name, version, sha256, keep, out):
    url = f"{REGISTRY}/{name}/-/{name}-{version}.tgz"
    with urllib.request.urlopen(url, timeout=60) as reply:
        data = reply.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"{url}: SHA-256 differs from the pinned one")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            path = member.name.removeprefix("package/")
            if member.isfile() and path.startswith(keep):
                target = out / name / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())


def main(out):
    out = Path(out)
    for name, version, sha256, keep in PACKAGES:
        stamp = out / name / f".{version}"
        if not stamp.exists():
            shutil.rmtree(out / name, ignore_errors=True)
            fetch(name, version, sha256, keep, out)
            stamp.touch()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "vendor")
