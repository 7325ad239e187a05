#!/bin/bash
# launcher_kill alone (bash docs/gpu_launcher_kill.sh; $OUT: summary.log and logs/kill.log), about
# a minute on one GPU: a --gpus 1 run whose launcher is killed with -9 mid-run
source "$(dirname "$0")/gpu_common.sh"
L=$R/logs; mkdir -p "$L"
launcher_kill
