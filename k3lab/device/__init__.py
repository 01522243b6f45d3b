"""What runs on the GPU machine itself: ``run.sh`` (the tier's steps, one call each),
``kda.sh`` (the KDA steps in one call), ``install.sh`` (unpack the offline bundle),
``no_compiled_vllm_shim.py`` (stands in for vLLM's compiled extension) and
``dsv3_build.py`` (tries to build v0.28.0's dsv3 fused-A kernel). See docs/gpu-lab.md."""
