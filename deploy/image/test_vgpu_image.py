"""Tests of vgpu-image: each flavour built from a release tarball onto a base image made here
(an OCI layout shaped like HAMi's, Volcano's and the DRA driver's images), then unpacked by an
independent OCI tool (umoci, Debian's) and checked: the files where the plugins look, the
library's checksum against the release's SHA256SUMS, what was removed, the entrypoint and
environment of the runtime configuration.

Run by `cargo xtask deploy-check`, which packages the workspace's build and passes the tarball
in VGPU_DIST_TARBALL; umoci must be on PATH (apt-get install umoci).
"""

import gzip
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import os
import pathlib
import shutil
import subprocess
import tarfile
import tempfile
import unittest

HERE = pathlib.Path(__file__).resolve().parent
loader = importlib.machinery.SourceFileLoader("vgpu_image", str(HERE / "vgpu-image"))
spec = importlib.util.spec_from_loader("vgpu_image", loader)
vgpu_image = importlib.util.module_from_spec(spec)
loader.exec_module(vgpu_image)

TOOLS = ["bash", "sh", "cp", "mv", "rm", "mkdir", "chmod", "cmp", "find", "dirname", "basename"]


def sha(data):
    return hashlib.sha256(data).hexdigest()


def make_base(layout, tag, layers, config, index_wrapped=False):
    """An OCI layout at `layout` with image `tag`: `layers` are lists of (path, kind, content)
    with kind file/dir/link/whiteout."""
    blobs = pathlib.Path(layout, "blobs", "sha256")
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data):
        (blobs / sha(data)).write_bytes(data)
        return {"digest": "sha256:" + sha(data), "size": len(data)}

    descs, diff_ids = [], []
    for layer in layers:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for path, kind, content in layer:
                info = tarfile.TarInfo(path)
                if kind == "dir":
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    t.addfile(info)
                elif kind == "link":
                    info.type, info.linkname = tarfile.SYMTYPE, content
                    t.addfile(info)
                else:
                    data = content.encode() if isinstance(content, str) else content
                    info.size, info.mode = len(data), 0o755
                    t.addfile(info, io.BytesIO(data))
        raw = buf.getvalue()
        diff_ids.append("sha256:" + sha(raw))
        descs.append({"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                      **put(gzip.compress(raw, mtime=0))})
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    manifest = {"schemaVersion": 2, "mediaType": vgpu_image.OCI_MANIFEST,
                "config": {"mediaType": vgpu_image.OCI_CONFIG, **put(json.dumps(cfg).encode())},
                "layers": descs}
    mdesc = {"mediaType": vgpu_image.OCI_MANIFEST, **put(json.dumps(manifest).encode())}
    if index_wrapped:
        mdesc["platform"] = {"os": "linux", "architecture": "amd64"}
        arm = {**mdesc, "platform": {"os": "linux", "architecture": "arm64"}}
        inner = {"schemaVersion": 2, "mediaType": vgpu_image.OCI_INDEX, "manifests": [arm, mdesc]}
        mdesc = {"mediaType": vgpu_image.OCI_INDEX, **put(json.dumps(inner).encode())}
    mdesc["annotations"] = {vgpu_image.REF_NAME: tag}
    pathlib.Path(layout, "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [mdesc]}))
    pathlib.Path(layout, "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')


def ubuntu_like():
    """A merged-/usr system layer: /bin -> usr/bin and the installer's tools."""
    return [("bin", "link", "usr/bin"), ("usr", "dir", None), ("usr/bin", "dir", None)] + [
        (f"usr/bin/{t}", "file", "#!tool") for t in TOOLS]


BASES = {
    "hami": ([ubuntu_like(), [
        ("k8s-vgpu", "dir", None), ("k8s-vgpu/lib", "dir", None), ("k8s-vgpu/lib/nvidia", "dir", None),
        ("k8s-vgpu/lib/nvidia/libvgpu.so.v2.10.0", "file", "HAMi-core"),
        ("k8s-vgpu/bin", "dir", None), ("k8s-vgpu/bin/vgpu-init.sh", "file", "cp in place"),
    ]], {"Env": ["PATH=/usr/bin:/bin"], "Entrypoint": None}),
    "volcano": ([ubuntu_like(), [
        ("k8s-vgpu", "dir", None), ("k8s-vgpu/lib", "dir", None), ("k8s-vgpu/lib/nvidia", "dir", None),
        ("k8s-vgpu/lib/nvidia/libvgpu.so", "file", "HAMi-core"),
        ("k8s-vgpu/lib/nvidia/ld.so.preload", "file", "/usr/local/vgpu/libvgpu.so\n"),
        ("usr/local", "dir", None), ("usr/local/vgpu", "dir", None),
        ("usr/bin/volcano-vgpu-device-plugin", "file", "plugin"),
    ]], {"Env": ["PATH=/usr/bin"], "Entrypoint": ["volcano-vgpu-device-plugin"]}),
    # Distroless: bash copied in, the rest behind a busybox directory on PATH.
    "hami-dra": ([[("bin", "dir", None), ("bin/bash", "file", "bash"), ("busybox", "dir", None)]
                  + [(f"busybox/{t}", "link", "/bin/bash") for t in TOOLS if t != "bash"]
                  + [("usr", "dir", None), ("usr/bin", "dir", None),
                     ("usr/bin/vgpu-init.sh", "file", "cp in place"), ("usr/local", "dir", None),
                     ("usr/local/lib", "dir", None), ("usr/local/lib/hami", "dir", None),
                     ("usr/local/lib/hami/libvgpu.so", "file", "HAMi-core"),
                     ("usr/local/lib/hami/ld.so.preload", "file", "/usr/local/vgpu/libvgpu.so\n")]],
                 {"Env": ["PATH=/busybox:/bin"], "Entrypoint": ["/bin/bash"]}),
}


class VgpuImageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dist = os.environ.get("VGPU_DIST_TARBALL")
        if not cls.dist:
            raise RuntimeError("VGPU_DIST_TARBALL is not set (cargo xtask deploy-check sets it)")
        if not shutil.which("umoci"):
            raise RuntimeError("umoci is not on PATH: apt-get install umoci (.ci/run does)")
        cls.release, cls.version = vgpu_image.read_release(cls.dist)

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="vgpu-image-")
        self.dir = pathlib.Path(self.tmp.name)

    def tearDown(self):
        self.tmp.cleanup()

    def build(self, flavour, base_layers=None, config=None, dist=None, extra=(), wrapped=False):
        layers, cfg = BASES[flavour]
        base = self.dir / f"base-{flavour}"
        shutil.rmtree(base, ignore_errors=True)
        make_base(base, "v1", base_layers or layers, config or cfg, index_wrapped=wrapped)
        return vgpu_image.main(["build", "--flavour", flavour, "--base", f"oci:{base}:v1",
                                "--dist", dist or self.dist, "--out",
                                f"oci:{self.dir / 'out'}:{flavour}", *extra])

    def unpack(self, flavour):
        bundle = self.dir / f"bundle-{flavour}"
        subprocess.run(["umoci", "unpack", "--image", f"{self.dir / 'out'}:{flavour}", str(bundle)],
                       check=True, capture_output=True)
        runtime = json.loads((bundle / "config.json").read_text())
        return bundle / "rootfs", runtime

    def lib_sum(self):
        return self.release[f"lib/libvgpu.so.{self.version}"], [
            line.split()[0] for line in self.release["SHA256SUMS"].decode().splitlines()
            if line.split()[1] == f"lib/libvgpu.so.{self.version}"][0]

    def assert_common(self, root):
        lib, want = self.lib_sum()
        self.assertEqual(sha((root / "opt/vgpu/bin/vgpu").read_bytes()),
                         sha(self.release["bin/vgpu"]))
        self.assertTrue((root / "opt/vgpu/LICENSE").is_file())
        return lib, want

    def test_hami(self):
        self.assertEqual(self.build("hami", extra=["--expect-plugin-version", "v2.10.0"], wrapped=True), 0)
        root, runtime = self.unpack("hami")
        _, want = self.assert_common(root)
        self.assertEqual(sha((root / "k8s-vgpu/lib/nvidia/libvgpu.so.v2.10.0").read_bytes()), want)
        self.assertEqual(sha((root / f"opt/vgpu/lib/libvgpu.so.{self.version}").read_bytes()), want)
        installer = root / "k8s-vgpu/bin/vgpu-init.sh"
        self.assertEqual(installer.read_bytes(), self.release["share/vgpu/vgpu-install-lib.sh"])
        self.assertTrue(os.access(installer, os.X_OK))
        self.assertEqual((root / "opt/vgpu/HAMI_PLUGIN_VERSION").read_text(), "v2.10.0\n")
        self.assertEqual(os.readlink(root / "usr/local/bin/vgpu"), "/opt/vgpu/bin/vgpu")
        # The base's own directories keep their place (no layer entry replaced them).
        self.assertTrue((root / "bin").is_symlink())

    def test_volcano(self):
        self.assertEqual(self.build("volcano"), 0)
        root, runtime = self.unpack("volcano")
        _, want = self.assert_common(root)
        self.assertEqual(sha((root / "opt/vgpu/node/libvgpu.so").read_bytes()), want)
        # The chart's postStart `cp -f /k8s-vgpu/lib/nvidia/*` finds nothing a container maps.
        self.assertEqual(sorted(p.name for p in (root / "k8s-vgpu/lib/nvidia").iterdir()), ["README.vgpu"])
        self.assertEqual(runtime["process"]["args"], [
            "/k8s-vgpu/bin/vgpu-install-lib.sh", "/usr/local/vgpu", "--", "volcano-vgpu-device-plugin"])
        self.assertIn("VGPU_SOURCE_DIR=/opt/vgpu/node", runtime["process"]["env"])

    def test_hami_dra(self):
        self.assertEqual(self.build("hami-dra"), 0)
        root, runtime = self.unpack("hami-dra")
        _, want = self.assert_common(root)
        self.assertEqual(sha((root / "usr/local/lib/hami/libvgpu.so").read_bytes()), want)
        self.assertEqual((root / "usr/bin/vgpu-init.sh").read_bytes(),
                         self.release["share/vgpu/vgpu-install-lib.sh"])
        self.assertIn("VGPU_SOURCE_DIR=/usr/local/lib/hami", runtime["process"]["env"])
        self.assertEqual(runtime["process"]["args"][0], "/bin/bash")

    def test_builds_are_reproducible(self):
        self.assertEqual(self.build("hami-dra"), 0)
        first = json.loads((self.dir / "out/index.json").read_text())["manifests"][0]["digest"]
        shutil.rmtree(self.dir / "out")
        self.assertEqual(self.build("hami-dra"), 0)
        again = json.loads((self.dir / "out/index.json").read_text())["manifests"][0]["digest"]
        self.assertEqual(first, again)

    def test_bad_inputs_are_refused_and_write_nothing(self):
        layers, cfg = BASES["hami"]
        two = [layers[0], layers[1] + [("k8s-vgpu/lib/nvidia/libvgpu.so.v2.9.0", "file", "old")]]
        self.assertEqual(self.build("hami", base_layers=two), 1)
        self.assertEqual(self.build("hami", extra=["--expect-plugin-version", "v2.9.0"]), 1)
        # A base whose later layer deleted the library (a whiteout) has nothing to replace.
        gone = [layers[0], layers[1], [("k8s-vgpu/lib/nvidia/.wh.libvgpu.so.v2.10.0", "file", "")]]
        self.assertEqual(self.build("hami", base_layers=gone), 1)
        # The DRA image without the installer's tools (no busybox on PATH).
        dra_layers, dra_cfg = BASES["hami-dra"]
        self.assertEqual(self.build("hami-dra", config={**dra_cfg, "Env": ["PATH=/bin"]}), 1)
        # A volcano base without an entrypoint to hand over to.
        vol_layers, vol_cfg = BASES["volcano"]
        self.assertEqual(self.build("volcano", config={**vol_cfg, "Entrypoint": None}), 1)
        # A tarball that is not the published one.
        bad = self.dir / "vgpu-bad.tar.gz"
        shutil.copyfile(self.dist, bad)
        with open(bad, "ab") as f:
            f.write(b"\0")
        shutil.copyfile(self.dist + ".sha256", str(bad) + ".sha256")
        self.assertEqual(self.build("hami-dra", dist=str(bad)), 1)
        self.assertFalse((self.dir / "out").exists())


if __name__ == "__main__":
    unittest.main()
