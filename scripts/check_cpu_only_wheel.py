"""Build a wheel with SHARDADAM_CUDA=OFF (`pip wheel .`), import its _core in
isolation and check it reports no CUDA. Run by CI; exits non-zero on failure.

It builds in the install's own build directory (pyproject.toml's build-dir):
the host objects' compile commands do not depend on SHARDADAM_CUDA, so ninja
keeps them and only the CUDA stub and the module are built again (a build
directory of its own compiled every CPU engine file a second time). The next
install with CUDA reconfigures the directory back."""
import os
import subprocess
import sys
import tempfile
import zipfile

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, SHARDADAM_CUDA="OFF")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", tmp, root], check=True, env=env)
    wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        z.extractall(os.path.join(tmp, "site"))
        names = z.namelist()
    for needed in ("shardadam/_core.pyi", "shardadam/py.typed", "shardadam/kernels.py"):
        assert needed in names, f"{needed} missing from the CPU-only wheel"
    check = ("import shardadam._core as c; info = c.build_info(); "
             "assert info['cuda'] is False and info['cuda_architectures'] == '', info; print('cpu-only wheel:', info)")
    subprocess.run([sys.executable, "-c", check], check=True, cwd=os.path.join(tmp, "site"),
                   env=dict(os.environ, PYTHONPATH=os.path.join(tmp, "site")))
print("cpu-only wheel OK")
