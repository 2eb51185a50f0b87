# Install rules, included by CMakeLists.txt when M40LLM_INSTALL is ON:
#   <libdir>/libm40llm.a (or .so), <includedir>/m40llm.h,
#   <libdir>/cmake/m40llm/m40llm{Config,ConfigVersion,Targets}.cmake  find_package(m40llm CONFIG)
#   <libdir>/pkgconfig/m40llm.pc                                        pkg-config [--static] m40llm
#   <datadir>/doc/m40llm/LICENSE-*
include(CMakePackageConfigHelpers)

set(M40LLM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/m40llm" CACHE STRING
    "Where the CMake package files are installed (relative to the prefix)")
set(M40LLM_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig" CACHE STRING
    "Where m40llm.pc is installed (relative to the prefix)")

install(TARGETS m40llm EXPORT m40llmTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES ${PROJECT_SOURCE_DIR}/c/include/m40llm.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE-MIT ${PROJECT_SOURCE_DIR}/LICENSE-APACHE
        DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/m40llm)
install(EXPORT m40llmTargets NAMESPACE m40llm:: DESTINATION ${M40LLM_INSTALL_CMAKEDIR})

# What the installed package needs at a consumer's link: a static archive passes on its link
# dependencies (Threads, libm, and with CUDA cudart_static, libdl, librt); a shared library
# keeps them inside.
get_target_property(m40llm_type m40llm TYPE)
if(m40llm_type STREQUAL "STATIC_LIBRARY")
  set(M40LLM_STATIC ON)
  set(M40LLM_SHARED OFF)
  set(m40llm_libs_private)
  if(M40LLM_HAVE_CUDA)
    get_target_property(m40llm_cudart CUDA::cudart_static IMPORTED_LOCATION)
    get_filename_component(m40llm_cudart_dir "${m40llm_cudart}" DIRECTORY)
    if(NOT m40llm_cudart_dir IN_LIST CMAKE_C_IMPLICIT_LINK_DIRECTORIES)
      list(APPEND m40llm_libs_private "-L${m40llm_cudart_dir}")
    endif()
    list(APPEND m40llm_libs_private -lcudart_static -ldl -lrt)
  endif()
  list(APPEND m40llm_libs_private -lpthread -lm)
else()
  set(M40LLM_STATIC OFF)
  set(M40LLM_SHARED ON)
  set(m40llm_libs_private)
endif()
string(REPLACE ";" " " m40llm_libs_private "${m40llm_libs_private}")

# m40llm.pc: relocatable (paths from ${pcfiledir}) unless the install directories are absolute.
if(IS_ABSOLUTE "${M40LLM_INSTALL_PKGCONFIGDIR}")
  set(m40llm_pc_prefix "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH m40llm_pc_up "/prefix/${M40LLM_INSTALL_PKGCONFIGDIR}" "/prefix")
  string(REGEX REPLACE "/$" "" m40llm_pc_up "${m40llm_pc_up}")
  set(m40llm_pc_prefix "\${pcfiledir}/${m40llm_pc_up}")
endif()
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(m40llm_pc_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(m40llm_pc_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
set(M40LLM_PC_LIBS_PRIVATE "@M40LLM_PC_LIBS_PRIVATE@")  # filled in by cmake/link_deps.cmake
configure_file(${PROJECT_SOURCE_DIR}/cmake/m40llm.pc.in ${PROJECT_BINARY_DIR}/m40llm.pc.in @ONLY)

# Whether the archive needs the C++ runtime (nvcc compiles the CUDA sources' host code as C++) is
# read from the built archive itself, after each link, by cmake/link_deps.cmake: m40llm.pc and the
# CMake package then declare -lstdc++ exactly when the archive has undefined C++ runtime symbols.
add_custom_command(TARGET m40llm POST_BUILD
  COMMAND ${CMAKE_COMMAND} "-DNM=${CMAKE_NM}" "-DLIBRARY=$<TARGET_FILE:m40llm>"
          "-DSTATIC=${M40LLM_STATIC}" "-DLIBS_PRIVATE=${m40llm_libs_private}"
          "-DPC_IN=${PROJECT_BINARY_DIR}/m40llm.pc.in" "-DPC_OUT=${PROJECT_BINARY_DIR}/m40llm.pc"
          "-DCMAKE_OUT=${PROJECT_BINARY_DIR}/m40llmLinkDeps.cmake"
          -P ${PROJECT_SOURCE_DIR}/cmake/link_deps.cmake
  VERBATIM)
install(FILES ${PROJECT_BINARY_DIR}/m40llm.pc DESTINATION ${M40LLM_INSTALL_PKGCONFIGDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/m40llmConfig.cmake.in
  ${PROJECT_BINARY_DIR}/m40llmConfig.cmake INSTALL_DESTINATION ${M40LLM_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/m40llmConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/m40llmConfig.cmake ${PROJECT_BINARY_DIR}/m40llmConfigVersion.cmake
              ${PROJECT_BINARY_DIR}/m40llmLinkDeps.cmake
        DESTINATION ${M40LLM_INSTALL_CMAKEDIR})
