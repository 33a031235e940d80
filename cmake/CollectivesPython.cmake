# Finds what the Python package needs, for the defaults of COLLECTIVES_BUILD_PYTHON and
# COLLECTIVES_BUILD_TORCH: Debian's interpreter with its development files, numpy and pybind11
# (python3-dev, python3-numpy, python3-pybind11); for the torch backend, libtorch-dev's CMake
# package and python3-torch in that same interpreter.

set(_default_python "")
if(EXISTS /usr/bin/python3)
  set(_default_python /usr/bin/python3)
endif()
set(COLLECTIVES_PYTHON "${_default_python}" CACHE FILEPATH
    "Python interpreter the modules are built for (default: Debian's /usr/bin/python3)")

set(_collectives_python_found OFF)
set(_collectives_torch_found OFF)
if(COLLECTIVES_PYTHON)
  set(Python3_EXECUTABLE ${COLLECTIVES_PYTHON})
  find_package(Python3 QUIET COMPONENTS Interpreter Development.Module)
  execute_process(COMMAND ${COLLECTIVES_PYTHON} -c "import numpy, pybind11; print(pybind11.get_cmake_dir())"
                  OUTPUT_VARIABLE _pybind11_dir OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _probe ERROR_QUIET)
  if(Python3_FOUND AND _probe EQUAL 0)
    find_package(pybind11 CONFIG QUIET HINTS ${_pybind11_dir})
    if(pybind11_FOUND)
      set(_collectives_python_found ON)
    endif()
  endif()
  if(_collectives_python_found)
    execute_process(COMMAND ${COLLECTIVES_PYTHON} -c "import torch.distributed"
                    RESULT_VARIABLE _probe OUTPUT_QUIET ERROR_QUIET)
    if(_probe EQUAL 0)
      find_package(Torch QUIET)
      if(Torch_FOUND)
        set(_collectives_torch_found ON)
      endif()
    endif()
  endif()
endif()
