#!/usr/bin/env bash
# Gradescope's setup (course/instructor.md): runs once when the autograder image is built, in /autograder/source,
# which holds this file, run_autograder, parts.txt and the instructor's repo in countdown/ (python
# course/grade.py --autograder autograder.zip --parts ... makes the zip). Installs the repo as README's
# install.sh does, torch's CPU build included: grading runs on Gradescope's CPUs.
set -euo pipefail
apt-get update -q && apt-get install -y -q python3 python3-venv python3-pip git
cd /autograder/source/countdown
./install.sh
