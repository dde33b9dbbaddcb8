#!/usr/bin/env bash
# Install this repo into ./.venv, the first half of README's first command (run_cpu.sh then finds the venv by
# itself; `. .venv/bin/activate` puts it on your PATH). Which torch build comes:
#   Linux without an NVIDIA GPU   the CPU build, from PyTorch's CPU wheel index (a plain `pip install torch` there
#                                 pulls the multi-GB CUDA build, which a CPU never uses)
#   Linux with nvidia-smi         the default (CUDA) build from PyPI
#   macOS (Apple Silicon)         the default build from PyPI (CPU and MPS); Intel Macs have no current torch wheels
#   Windows                       use WSL2 (Ubuntu), then as Linux
#   a wheel of torch 2.13.0 in a folder of $PIP_FIND_LINKS (an offline machine, this project's CI): that one
# TORCH_INDEX=URL ./install.sh takes torch from another index (e.g. a CUDA version's); PYTHON=python3.12 picks the
# interpreter (3.10 or newer) that makes the venv.
set -euo pipefail
cd "$(dirname "$0")"
TORCH=torch==2.13.0
PY=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z $PY ]] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "error: this needs Python 3.10 or newer as python3 (or PYTHON=/path/to/python ./install.sh)" >&2; exit 2
fi
if [[ ! -x .venv/bin/python ]]; then
  echo "+ $PY -m venv .venv"
  "$PY" -m venv .venv || { rm -rf .venv
    echo "error: could not make a virtual environment; on Debian/Ubuntu/WSL: sudo apt install python3-venv" >&2
    exit 2; }
fi
local_wheel=""
for d in ${PIP_FIND_LINKS:-}; do
  if compgen -G "$d/torch-2.13.0*.whl" > /dev/null; then local_wheel=$d; fi
done
if [[ -n ${TORCH_INDEX:-} ]]; then
  FROM=(--index-url "$TORCH_INDEX")
elif [[ -n $local_wheel ]]; then
  FROM=()  # pip takes it from PIP_FIND_LINKS
elif [[ $(uname -s) == Linux ]] && ! command -v nvidia-smi > /dev/null; then
  FROM=(--index-url https://download.pytorch.org/whl/cpu)
else
  FROM=()
fi
# --no-compile: pip byte-compiles every file it installs (most of torch's install time), where the scripts import a
# small part of them; the last command compiles that part once (where PYTHONDONTWRITEBYTECODE is set, as in this
# project's CI, every process would compile it again)
echo "+ .venv/bin/python -m pip install --no-compile $TORCH ${FROM[*]:-}"
.venv/bin/python -m pip install -q --no-compile "$TORCH" ${FROM[@]+"${FROM[@]}"}
echo "+ .venv/bin/python -m pip install --no-compile -e .[test,plots]"
.venv/bin/python -m pip install -q --no-compile -e ".[test,plots]"
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import io, numpy.ctypeslib, torch, matplotlib.pyplot as plt, peft, pytest, xdist, hypothesis
import sft, ipo, rloo, grpo, opd, rlt, evaluate, plumbing.pipeline, plumbing.machine
from plumbing.models import cpu_bf16, load_model
load_model('pretrained/tiny-base'), torch.save({}, io.BytesIO()), plt.figure().savefig(io.BytesIO(), format='png')
print(f'torch {torch.__version__}, {torch.get_num_threads()} cores, native bf16', 'yes' if cpu_bf16() else 'no', \
'(./run_cpu.sh measures which precision trains faster here before its first stage)')"
