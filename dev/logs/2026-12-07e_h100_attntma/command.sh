#!/bin/bash
# attntma (issue 36): each version of dev/variants/attention_forward_tma.cu (TMA + mbarriers, a producer warpgroup,
# a consumer warpgroup per query head) against float64 at T 512 and 320, then timed beside the product's
# attention_forward_bf16_kernel_64 at B 64 and B 16 (OK / NOT OK per version and shape, "all OK"); a hang ends at 60 s
timeout 60 python dev/variants/attention_forward_tma.py
