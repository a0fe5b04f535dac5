"""The command line itself: `hvdtrain --help` answers without importing torch or Horovod."""
import sys

from helpers import run_cmd


def test_cli_module_imports_no_torch():
    proc = run_cmd([sys.executable, "-c", "import sys, hvdtrain.cli; "
                    "print(sorted(m for m in ('torch', 'horovod', 'transformers', 'datasets') if m in sys.modules))"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
