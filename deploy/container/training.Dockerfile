# Example: add node-agent to your training image. node-agent needs no torch of its own (torch is
# only in the package's optional "train" extra): pip keeps the image's torch and CUDA as they are.
#
# In your training project, with the launcher's wheel built next to it:
#   pip wheel --no-deps -w wheels /path/to/elastic-launcher
#   docker build -f training.Dockerfile -t my-training:1 .
# Pods or hosts then run: node-agent --endpoint rdzv-server:29400 ... train.py (see docs/deploy.md).

ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}
COPY wheels/ /tmp/wheels/
# Installs node-agent, rdzv-ctl and their small dependencies (aiohttp, msgspec, prometheus-client).
RUN python -m pip install --no-cache-dir /tmp/wheels/elastic_launcher-*.whl \
 && rm -rf /tmp/wheels
WORKDIR /workspace
COPY train.py ./
# No ENTRYPOINT: the Job or srun line says `node-agent ... train.py`, as it would say `torchrun`.
CMD ["node-agent", "--standalone", "--nproc", "gpu", "train.py"]
