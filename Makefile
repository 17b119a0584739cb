# The course's commands. Each one sets itself up: a .venv with the pinned versions.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
GPU_PYTHON ?= 3.12   # the GPU machine's Python, for make gpu-wheels
# Hang guards, far above what a busy machine needs (notebook cells take seconds to a minute and
# every distributed wait has its own deadline): a cell past 600 s is interrupted by nbval (its
# traceback shows where it was, and the kernel is free for the next cell); pytest-timeout's 900 s
# (pyproject.toml) is the guard above it: when it fired first, the kernel went on running the late
# cell and every later cell queued behind it.
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 --sanitize-with tests/nbval_sanitize.cfg

# PyTorch's CPU build by default (PyPI's torch on Linux is the CUDA build: several GB more). The
# index is used only when it answers within 3 s, so an offline mirror keeps working. With GPUs:
# make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128   (or TORCH_INDEX= for PyPI's)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# the optional extras installed with the course (CI adds ft: torchft, for notebook 11)
EXTRAS ?= mpi,dev
TORCH_INDEX_ARG = $(shell python3 -c "import sys, urllib.request; \
	urllib.request.urlopen(sys.argv[1], timeout=3); print('--extra-index-url', sys.argv[1])" \
	$(TORCH_INDEX) 2>/dev/null)

.PHONY: setup demo test test-lib test-notebooks lint lab labs hub site slides images clean-cluster clean \
        gpu-wheels gpu-check

setup: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH_INDEX_ARG) -e '.[$(EXTRAS)]'
	@# ipyparallel's cluster panel starts clusters outside the course's profile, and its server
	@# extension's old entry point makes JupyterLab print a warning at every start: both off
	$(VENV)/bin/jupyter server extension disable --sys-prefix ipyparallel >/dev/null 2>&1
	$(VENV)/bin/jupyter labextension disable --level=sys_prefix ipyparallel-labextension >/dev/null 2>&1
	-git rev-parse --git-dir >/dev/null 2>&1 && $(VENV)/bin/nbstripout --install
	touch $(STAMP)

demo: $(STAMP)            ## the headless tour: cluster, algorithms, summary table, figures
	$(PY) -m course_lib demo

test: test-lib test-notebooks lint   ## the whole suite: library tests, every notebook and lab

# Two pytest workers, one test file or notebook each at a time (much of the suite waits:
# clusters starting, deadlines, emulated links; two overlap on 2 cores: ~1/3 faster).
# JOBS=0: one process, the order of a plain pytest run.
JOBS   ?= 2
XDIST   = $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

# each ends with its ten slowest items, so the next slow test or notebook cell shows itself
test-lib: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=10 tests

test-notebooks: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 $(NBVAL) notebooks labs

lint: $(STAMP)
	$(PY) -m ruff check course_lib tests

# Kernels started by JupyterLab and nbconvert get CurveZMQ keys (their kernelspec supports them), so
# their messages are encrypted and ipykernel does not warn about plain TCP
KERNEL_ARGS := --KernelManager.transport_encryption=auto

# JupyterLab refuses to run as root without --allow-root: containers and course VMs often are root
ALLOW_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

lab: $(STAMP)             ## JupyterLab on the whole course (notebooks and labs), opened at notebook 00
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=$(CURDIR) $(ALLOW_ROOT) \
		$(KERNEL_ARGS) $(LAB_ARGS) notebooks/00_welcome_and_cluster.ipynb

labs: $(STAMP)            ## regenerate the student labs from labs/solutions/
	$(PY) -m course_lib labs build

# The site and the decks share the notebooks' executed outputs (a jupyter-cache in build/): each
# notebook is executed once, and again only when its code changes. Both work offline: MathJax,
# reveal.js and require.js are fetched once (pinned, checked) into slides/vendor/.
# The class server (see the README): JupyterHub from the class extra, its proxy from npm, as root
CLASS_STAMP := $(VENV)/.installed-class
$(CLASS_STAMP): $(STAMP) hub/package.json
	$(PY) -m pip install -q -c constraints.txt -e '.[class]'
	npm install --prefix hub --no-audit --no-fund --loglevel=error
	touch $(CLASS_STAMP)

# exec: make passes a SIGTERM on to its command, which is then the hub itself (not a shell)
hub: $(CLASS_STAMP)       ## the class server on 127.0.0.1:8000, run as root (accounts: hub/users.sh)
	cd hub && exec $(abspath $(VENV))/bin/jupyterhub -f jupyterhub_config.py

SITE_STAMP := $(VENV)/.installed-site
$(SITE_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[site]'
	touch $(SITE_STAMP)

# A subset: NOTEBOOKS="notebooks/09_*.ipynb" (globs, space-separated) for both; the decks take the
# notebooks/ ones (labs/ globs are for the site). SITE_NOTEBOOKS, the site's own, wins for the site.
# The default is the whole course.
SITE_NOTEBOOKS ?= $(NOTEBOOKS)
DECKS = $(sort $(wildcard $(if $(NOTEBOOKS),$(filter notebooks/%,$(NOTEBOOKS)),notebooks/*.ipynb)))

site: $(SITE_STAMP)       ## the course as a static website, in build/site/ (open index.html)
	$(PY) slides/vendor.py slides/vendor
	$(if $(SITE_NOTEBOOKS),SITE_NOTEBOOKS="$(SITE_NOTEBOOKS)") $(VENV)/bin/sphinx-build -q -c site -b html . build/site
	@echo "the site: $(CURDIR)/build/site/index.html"

slides: $(SITE_STAMP)     ## a reveal.js deck per notebook, in slides/ (outputs shared with make site)
	$(if $(DECKS),,$(error NOTEBOOKS="$(NOTEBOOKS)" names no notebook of notebooks/))
	$(PY) slides/vendor.py slides/vendor
	$(VENV)/bin/jupyter nbconvert --config slides/config.py --to slides $(KERNEL_ARGS) \
		--output-dir slides $(DECKS)

images: $(STAMP)          ## regenerate the figures in images/
	$(PY) -m course_lib images

gpu-wheels: $(STAMP)      ## wheels a GPU machine without network lacks, into .whl/ (Python 3.12)
	$(PY) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
	  -c constraints.txt -d .whl ipyparallel ipywidgets nbval nbformat cloudpickle mpi4py mpich

gpu-check:                ## on a GPU machine: scripts/gpu-check.sh (report in gpu-check/)
	scripts/gpu-check.sh gpu-check

clean-cluster: $(STAMP)   ## stop clusters left behind by a killed notebook kernel
	$(PY) -m course_lib cluster clean

clean:
	rm -rf slides/*.html slides/vendor build/site build/jupyter_cache demo_output .pytest_cache
