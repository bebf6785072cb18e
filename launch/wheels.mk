# Wheels for the GPU benchmark machine, fetched here (a machine that reaches PyPI) and carried
# with the tree in .whl/ (ignored by git), for `launch/gpu_benchmark.sh` to install offline.
#
#   make -f launch/wheels.mk wheels            # Python 3.12, x86-64 Linux (the GPU image's Python)
#   make -f launch/wheels.mk wheels PY=3.11    # another target Python
#
# The GPU image is assumed to hold JAX with CUDA, torch, numpy, tensorstore, tokenizers, optax,
# pyyaml and tqdm; these are what stencil needs beyond them (no dependencies are resolved:
# --no-deps; add a name to PACKAGES if the image lacks one). Each must be a binary wheel.
PY ?= 3.12
DEST ?= .whl
CORE = draccus mergedeep pyyaml-include toml typing-inspect mypy-extensions jax-triton
# FlashAttention-4 and QuACK (CuTe DSL): several hundred MB unpacked. The CuTe DSL's libs come
# per CUDA major version (-cu12 here; pick the one matching the image's CUDA).
KERNELS = flash-attn-4 quack-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base \
          nvidia-cutlass-dsl-libs-cu12 apache-tvm-ffi torch-c-dlpack-ext einops
PACKAGES ?= $(CORE) $(KERNELS)
PLATFORMS = manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
            manylinux2014_x86_64 manylinux1_x86_64

.PHONY: wheels wheels-core clean
wheels-core:  # without the CuTe DSL kernels (where what travels is limited in size): flash4/quack then say unavailable
	$(MAKE) -f $(firstword $(MAKEFILE_LIST)) wheels PACKAGES="$(CORE)"
wheels:
	mkdir -p $(DEST)
	python3 -m pip download --no-deps --only-binary=:all: --python-version $(PY) --implementation cp \
	    $(foreach p,$(PLATFORMS),--platform $(p)) -d $(DEST) $(PACKAGES)
	@ls -la $(DEST); du -sh $(DEST)
clean:
	rm -rf $(DEST)
