# What the build needs before anything is compiled, each refused with a message that names what
# is missing and the Debian package that provides it: `pip install .` (or a configure) on a machine
# without a C++20 compiler or without one of the libraries says so at once, not after a page of
# CMake's generic text.

# The C++ compiler: C++20 as GCC 12 or clang 14 (the compilers the project builds and tests with)
# and later accept it. Enables the language.
macro(moe_ep_require_cxx20)
  include(CheckLanguage)
  check_language(CXX)
  if(NOT CMAKE_CXX_COMPILER)
    message(FATAL_ERROR "moe-ep needs a C++20 compiler (g++ 12 or clang++ 14, or later) and none was found "
                        "(CXX, or c++/g++/clang++ on PATH). On Debian or Ubuntu: apt-get install g++")
  endif()
  enable_language(CXX)
  set(moe_ep_cxx_least "")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set(moe_ep_cxx_least 12)
  elseif(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    set(moe_ep_cxx_least 14)
  endif()
  if(NOT "cxx_std_20" IN_LIST CMAKE_CXX_COMPILE_FEATURES
     OR (moe_ep_cxx_least AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS moe_ep_cxx_least))
    message(FATAL_ERROR "moe-ep needs a C++20 compiler (g++ 12 or clang++ 14, or later); the compiler found is "
                        "${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION} (${CMAKE_CXX_COMPILER}). "
                        "Point CXX at a newer one; on Debian 12: apt-get install g++")
  endif()
endmacro()

# moe_ep_require_package(<find_package name> <Debian package>): the package's CMake
# configuration, or an error naming the Debian package to install.
macro(moe_ep_require_package name debian)
  find_package(${name} QUIET)
  if(NOT ${name}_FOUND)
    message(FATAL_ERROR "moe-ep needs ${name} (its CMake package was not found on CMAKE_PREFIX_PATH or in the "
                        "system's folders). On Debian or Ubuntu: apt-get install ${debian}")
  endif()
endmacro()
