# Finds a CUDA toolkit and picks architectures. Sets M40LLM_HAVE_CUDA and, with CUDA,
# M40LLM_CUDA_ARCHITECTURES (the list as the library reports it, in one form for every build).
#
# Default architectures: the M40 (sm_52 SASS plus compute_52 PTX, which newer GPUs JIT-compile)
# when the toolkit can build it; otherwise the lowest architecture it can build, with a message.
# Any list can be given with -DCMAKE_CUDA_ARCHITECTURES=...
set(M40LLM_HAVE_CUDA OFF)
if(NOT M40LLM_ENABLE_CUDA)
  message(STATUS "m40llm: CUDA backend disabled (M40LLM_ENABLE_CUDA=OFF): CPU backend only")
  return()
endif()

# Locate nvcc the way the setup script does, to learn its version before CMake tests it.
set(_m40llm_nvcc "$ENV{CUDACXX}")
if(NOT _m40llm_nvcc)
  find_program(_m40llm_nvcc_found nvcc
    HINTS ENV CUDA_PATH ENV CUDA_HOME PATH_SUFFIXES bin
    PATHS /usr/local/cuda/bin)
  set(_m40llm_nvcc "${_m40llm_nvcc_found}")
endif()
if(_m40llm_nvcc AND NOT CMAKE_CUDA_COMPILER)
  set(CMAKE_CUDA_COMPILER "${_m40llm_nvcc}" CACHE FILEPATH "CUDA compiler")
endif()
if(_m40llm_nvcc)
  execute_process(COMMAND "${_m40llm_nvcc}" --version OUTPUT_VARIABLE _nvcc_version_text)
  string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _ "${_nvcc_version_text}")
  # CUDA 11.x refuses GCC newer than 11: pick a host compiler it accepts unless one is given.
  if(CMAKE_MATCH_1 AND CMAKE_MATCH_1 LESS 12 AND NOT DEFINED CACHE{CMAKE_CUDA_HOST_COMPILER}
     AND NOT DEFINED ENV{CUDAHOSTCXX})
    execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -dumpversion OUTPUT_VARIABLE _cxx_version)
    if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR _cxx_version VERSION_GREATER_EQUAL 12)
      find_program(_m40llm_old_cxx NAMES g++-11 g++-10 clang++-14)
      if(_m40llm_old_cxx)
        set(CMAKE_CUDA_HOST_COMPILER "${_m40llm_old_cxx}" CACHE FILEPATH "CUDA host compiler")
        message(STATUS "m40llm: CUDA ${CMAKE_MATCH_1}.${CMAKE_MATCH_2} host compiler: ${_m40llm_old_cxx}")
      endif()
    endif()
  endif()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(WARNING "m40llm: no CUDA toolkit found: building the CPU backend only. "
                  "Run scripts/setup.sh or set CUDACXX to enable the CUDA backend.")
  return()
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-arch
                  OUTPUT_VARIABLE _archs RESULT_VARIABLE _rc ERROR_QUIET)
  string(REGEX MATCHALL "compute_[0-9]+" _archs "${_archs}")
  if(_rc EQUAL 0 AND "compute_52" IN_LIST _archs)
    set(CMAKE_CUDA_ARCHITECTURES "52-real;52-virtual")
  elseif(_rc EQUAL 0 AND _archs)
    list(GET _archs 0 _lowest)
    string(REPLACE "compute_" "" _lowest "${_lowest}")
    set(CMAKE_CUDA_ARCHITECTURES "${_lowest}-real;${_lowest}-virtual")
    message(STATUS "m40llm: this CUDA toolkit cannot build sm_52 (the M40); defaulting to "
                   "sm_${_lowest}. Use CUDA 11.8 (scripts/setup.sh) for M40 support.")
  else()
    set(CMAKE_CUDA_ARCHITECTURES "52-real;52-virtual")
  endif()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(M40LLM_HAVE_CUDA ON)

# The architectures as m40llm_build_info reports them, in the form rust/m40llm-sys/build.rs writes
# too: each entry NN-real (SASS) or NN-virtual (PTX), sorted, no duplicates. CMake's all,
# all-major and native become the lists CMake itself builds for them. cuda/build_info.cu checks
# the result against what nvcc compiles.
set(M40LLM_CUDA_ARCHITECTURES)
foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
  string(TOUPPER "${_arch}" _named)
  string(REPLACE "-" "_" _named "CMAKE_CUDA_ARCHITECTURES_${_named}")
  if(_arch MATCHES "^(all|all-major|native)$" AND DEFINED ${_named})
    set(_entries ${${_named}})
  else()
    set(_entries ${_arch})
  endif()
  foreach(_entry IN LISTS _entries)
    if(_entry MATCHES "^[0-9]+[a-z]*$")
      list(APPEND M40LLM_CUDA_ARCHITECTURES "${_entry}-real" "${_entry}-virtual")
    elseif(_entry MATCHES "^[0-9]+[a-z]*-(real|virtual)$")
      list(APPEND M40LLM_CUDA_ARCHITECTURES "${_entry}")
    else()
      message(FATAL_ERROR "m40llm: CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES}: m40llm "
                          "reports the architectures it carries (m40llm_build_info_get) and "
                          "cannot tell them from \"${_entry}\": name them, e.g. "
                          "\"52-real;52-virtual;90-real\"")
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES M40LLM_CUDA_ARCHITECTURES)
list(SORT M40LLM_CUDA_ARCHITECTURES COMPARE NATURAL)
message(STATUS "m40llm: CUDA backend ON, nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
               "architectures ${M40LLM_CUDA_ARCHITECTURES}")
