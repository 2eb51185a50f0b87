# The shapes (B,H,Hkv,D,L) of the K/V format comparisons: bench/formats.sh and the abformats
# step of scripts/gpu_check.sh. Groups 1, 2 (16/8 at head_dim 256, as Gemma-2), 4, 7 (28/4, as
# Qwen2.5-7B: an 8-head tile) and 8; contexts 1K-32K.
FORMAT_SHAPES=(1,32,32,128,8192 1,32,32,128,32768 8,32,32,128,8192 8,32,8,128,8192 1,32,8,128,32768
               8,64,8,128,8192 8,32,8,64,8192 32,32,8,128,2048 1,32,8,128,1024 8,16,8,256,8192
               8,28,4,128,8192)
