# What `cmake --install` adds around the libraries (src/CMakeLists.txt installs those and the
# headers): the CMake package lib/cmake/moe_ep (find_package(moe_ep CONFIG): targets moe_ep::moe_ep
# and, with MPI, moe_ep::mpi) and the pkg-config files lib/pkgconfig/moe_ep.pc and moe_ep_mpi.pc.
include(CMakePackageConfigHelpers)

set(MOE_EP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/moe_ep)
set(MOE_EP_PKGCONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# ---- CMake package ----------------------------------------------------------------------------
install(EXPORT moe_ep_targets NAMESPACE moe_ep:: FILE moe_epTargets.cmake DESTINATION ${MOE_EP_CMAKE_DIR})
if(MOE_EP_WITH_MPI)
  install(EXPORT moe_ep_mpi_targets NAMESPACE moe_ep:: FILE moe_epMpiTargets.cmake DESTINATION ${MOE_EP_CMAKE_DIR})
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/moe_epConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/cmake/moe_epConfig.cmake
                              INSTALL_DESTINATION ${MOE_EP_CMAKE_DIR})
# 0.x releases: a request for 0.1 accepts 0.1.y and 0.2 (same major version), never 1.0.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/moe_epConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/moe_epConfig.cmake ${PROJECT_BINARY_DIR}/cmake/moe_epConfigVersion.cmake
        DESTINATION ${MOE_EP_CMAKE_DIR})

# ---- pkg-config -------------------------------------------------------------------------------
# Flags of the third-party headers the public headers include (dlpack/dlpack.h from tensor.hpp,
# mpi.h from mpi.hpp), without the compiler's own include folders.
function(moe_ep_pc_cflags out)
  set(flags "")
  foreach(dir ${ARGN})
    if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES AND NOT dir STREQUAL "/usr/include")
      list(APPEND flags "-I${dir}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES flags)
  list(JOIN flags " " flags)
  set(${out} "${flags}" PARENT_SCOPE)
endfunction()

get_target_property(MOE_EP_DLPACK_INCLUDES dlpack::dlpack INTERFACE_INCLUDE_DIRECTORIES)
if(NOT MOE_EP_DLPACK_INCLUDES)
  set(MOE_EP_DLPACK_INCLUDES "")
endif()
moe_ep_pc_cflags(MOE_EP_PC_DLPACK_CFLAGS ${MOE_EP_DLPACK_INCLUDES})
set(MOE_EP_PC_TEMPLATES moe_ep)
if(MOE_EP_WITH_MPI)
  moe_ep_pc_cflags(MOE_EP_PC_MPI_CFLAGS ${MPI_CXX_INCLUDE_DIRS})
  foreach(def ${MPI_CXX_COMPILE_DEFINITIONS})
    string(APPEND MOE_EP_PC_MPI_CFLAGS " -D${def}")
  endforeach()
  foreach(opt ${MPI_CXX_COMPILE_OPTIONS})
    string(APPEND MOE_EP_PC_MPI_CFLAGS " ${opt}")
  endforeach()
  string(STRIP "${MOE_EP_PC_MPI_CFLAGS}" MOE_EP_PC_MPI_CFLAGS)
  # The C library only (MPI_CXX_SKIP_MPICXX): the MPI C++ bindings are neither used nor needed.
  set(MOE_EP_PC_MPI_LIBS "${MPI_CXX_LINK_FLAGS}")
  foreach(lib ${MPI_CXX_LIBRARIES})
    get_filename_component(name ${lib} NAME)
    if(NOT name MATCHES "mpi_cxx|mpicxx")
      string(APPEND MOE_EP_PC_MPI_LIBS " ${lib}")
    endif()
  endforeach()
  string(STRIP "${MOE_EP_PC_MPI_LIBS}" MOE_EP_PC_MPI_LIBS)
  list(APPEND MOE_EP_PC_TEMPLATES moe_ep_mpi)
endif()

# The prefix is known only when installing (cmake --install --prefix P): the .pc files are
# written then, from templates whose other fields are filled in now.
set(MOE_EP_PC_PREFIX "%MOE_EP_INSTALL_PREFIX%")
foreach(pc ${MOE_EP_PC_TEMPLATES})
  configure_file(${CMAKE_CURRENT_LIST_DIR}/${pc}.pc.in ${PROJECT_BINARY_DIR}/cmake/${pc}.pc.template @ONLY)
  install(CODE "
    file(READ \"${PROJECT_BINARY_DIR}/cmake/${pc}.pc.template\" pc)
    string(REPLACE \"%MOE_EP_INSTALL_PREFIX%\" \"\${CMAKE_INSTALL_PREFIX}\" pc \"\${pc}\")
    file(WRITE \"${PROJECT_BINARY_DIR}/cmake/pkgconfig/${pc}.pc\" \"\${pc}\")")
  install(FILES ${PROJECT_BINARY_DIR}/cmake/pkgconfig/${pc}.pc DESTINATION ${MOE_EP_PKGCONFIG_DIR})
endforeach()
