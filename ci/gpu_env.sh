# Sourced at the start of a device-tool command on the lent GPU machine (never in CI):
#   source ci/gpu_env.sh && python3 -m attnreg.tools.cli devices
# attnreg is not pip-installed there, so its built-in plugins are named through
# ATTNREG_PLUGINS (the registry's documented way to load plugins without entry points).
source .gpu/activate.sh
export ATTNREG_PLUGINS=attnreg.backends.reference.plugin,attnreg.backends.webgpu.plugin,attnreg.backends.opencl.plugin,attnreg.backends.dawn.plugin
