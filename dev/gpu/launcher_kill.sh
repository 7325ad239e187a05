#!/bin/bash
# launcher_kill alone (bash dev/gpu/launcher_kill.sh OUTDIR; OUTDIR: summary.log and logs/kill.log), about
# a minute on one GPU: a --gpus 1 run whose launcher is killed with -9 mid-run
source "$(dirname "$0")/common.sh"
L=$R/logs; mkdir -p "$L"
launcher_kill
