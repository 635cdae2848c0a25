# The two commands a fresh machine needs (see README.md):
#   make demo   set up, start the local Slurm cluster, run configs/local-tiny.toml end to end, show the report
#   make test   set up, start the local Slurm cluster, run the test suite
PYTHON ?= python3
PIP = $(PYTHON) -m pip
STAMP = .setup-done

.PHONY: setup cluster demo demo-text demo-sft report-image test test-serial lint hooks clean-demo

# torch 2.13.0 is the CPU build on these machines' disk; installing it first keeps pip from pulling a
# multi-GB CUDA build for the range in setup.cfg.
$(STAMP): setup.cfg pyproject.toml
	$(PIP) install --quiet --disable-pip-version-check torch==2.13.0
	$(PIP) install --quiet --disable-pip-version-check -e '.[train,report,test,data,loggers]'
	touch $(STAMP)

setup: $(STAMP)

cluster: setup
	bridge-cluster up

demo: cluster
	bridge-submit configs/local-tiny.toml --wait
	bridge-report runs/local-tiny --plot runs/local-tiny/report.png

# The real-data demo (configs/local-tiny-text.toml): the standard library's docstrings as the corpus
# (nothing is downloaded), prepared into indexed datasets, trained on, and the validation losses shown.
demo-text: cluster
	$(PYTHON) -m bridge_hpc.prepare.stdlib_corpus data/stdlib
	bridge-prepare-data --input data/stdlib/train.jsonl data/stdlib/valid.jsonl --output-prefix data/stdlib/docs \
	    --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
	bridge-submit configs/local-tiny-text.toml --wait
	bridge-report runs/local-tiny-text
	grep -h 'validation loss' runs/local-tiny-text/logs/*_0_log.out

# The fine-tuning demo (configs/local-tiny-sft.toml): demo-text's model fine-tuned on prompt/answer pairs
# made from the same docstrings ("Docstring of json.dumps:" -> its docstring).
demo-sft: demo-text
	$(PYTHON) -m bridge_hpc.prepare.stdlib_corpus data/stdlib-sft --sft
	bridge-submit configs/local-tiny-sft.toml --wait
	bridge-report runs/local-tiny-sft
	grep -h 'validation loss' runs/local-tiny-sft/logs/*_0_log.out

# docs/report.png, README's report image: the demo preempted once, requeued and finished.
report-image: cluster
	rm -rf runs/report-image
	$(PYTHON) scripts/report_image.py

# The Slurm tests and the rest side by side (scripts/run_tests.py says why); `make test-serial` runs
# them one after another in one pytest.
test: cluster
	$(PYTHON) scripts/run_tests.py -q tests

test-serial: cluster
	$(PYTHON) -m pytest -q tests

lint: setup
	$(PYTHON) -m ruff check bridge_hpc tests benchmarks scripts
	$(PYTHON) scripts/check_commit_subjects.py

# git's commit-msg hook: a commit whose subject is over 72 characters is refused when it is made.
hooks:
	mkdir -p "$$(git rev-parse --git-path hooks)"
	cp scripts/commit-msg "$$(git rev-parse --git-path hooks)/commit-msg"

clean-demo:
	rm -rf runs/local-tiny runs/local-tiny-text runs/local-tiny-sft
