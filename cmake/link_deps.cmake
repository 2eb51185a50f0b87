# Run after each link of the m40llm target (cmake/install.cmake): writes m40llm.pc and
# m40llmLinkDeps.cmake with the C++ runtime declared exactly when the built archive needs it.
#   cmake -DNM=nm -DLIBRARY=libm40llm.a -DSTATIC=ON|OFF -DLIBS_PRIVATE="-l..." \
#         -DPC_IN=m40llm.pc.in -DPC_OUT=m40llm.pc -DCMAKE_OUT=m40llmLinkDeps.cmake -P link_deps.cmake
# The CUDA sources are compiled as C++ by nvcc: if their host code uses the C++ runtime (operator
# new/delete, std::, exceptions, guarded statics), a C program linking the archive needs -lstdc++.
# A shared library links it itself, so only a static archive is examined.
cmake_minimum_required(VERSION 3.18)
set(cxx_runtime)
if(STATIC)
  if(NOT NM)
    set(NM nm)
  endif()
  execute_process(COMMAND "${NM}" -g "${LIBRARY}" OUTPUT_VARIABLE symbols RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "m40llm: ${NM} -g ${LIBRARY} failed: ${err}")
  endif()
  string(REGEX MATCHALL "[0-9a-fA-F]+ [A-TV-Za-z] [^\n]+" defined_lines "${symbols}")
  string(REGEX MATCHALL " U [^\n]+" undefined_lines "${symbols}")
  set(defined)
  foreach(line IN LISTS defined_lines)
    string(REGEX REPLACE "^[0-9a-fA-F]+ [A-Za-z] " "" name "${line}")
    list(APPEND defined "${name}")
  endforeach()
  set(cxx_symbols)
  foreach(line IN LISTS undefined_lines)
    string(REGEX REPLACE "^ U " "" name "${line}")
    if(name MATCHES "^(_Z|__cxa_|__gxx_personality|_Unwind_)"
       AND NOT name MATCHES "^__cxa_(atexit|finalize|thread_atexit_impl)$"
       AND NOT name IN_LIST defined)
      list(APPEND cxx_symbols "${name}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES cxx_symbols)
  if(cxx_symbols)
    set(cxx_runtime stdc++)
    message(STATUS "m40llm: the archive uses the C++ runtime (${cxx_symbols}): "
                   "m40llm.pc and the CMake package add -lstdc++")
  endif()
endif()

set(M40LLM_PC_LIBS_PRIVATE "${LIBS_PRIVATE}")
if(cxx_runtime)
  set(M40LLM_PC_LIBS_PRIVATE "${M40LLM_PC_LIBS_PRIVATE} -lstdc++")
endif()
configure_file("${PC_IN}" "${PC_OUT}" @ONLY)
file(WRITE "${CMAKE_OUT}.tmp"
     "# Written by cmake/link_deps.cmake from the built library: the C++ runtime it needs, if any.\n"
     "set(M40LLM_CXX_RUNTIME_LIBS \"${cxx_runtime}\")\n")
configure_file("${CMAKE_OUT}.tmp" "${CMAKE_OUT}" COPYONLY)
file(REMOVE "${CMAKE_OUT}.tmp")
