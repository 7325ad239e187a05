#!/bin/bash
# attn (issue 36): every version of dev/variants/attention_forward_wgmma.cu against float64, then timed beside
# the product's attention_forward_bf16_kernel_64 at B 64 and B 16 (prints OK / NOT OK per version, "all OK")
python dev/variants/attention_forward_wgmma.py
