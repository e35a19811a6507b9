# Proof that scripts/check_layers.py catches what it is for (CTest structure.layers_catch_violations):
# a copy of src/, include/, python/src/ and tools/ passes; the same copy with an upward include, an
# include between the two buffer generations, an internal header in a public one, an unlisted
# public header, an internal header in the Python extension (python/src/ and python/src/mpi/) and
# one in the tool that its allow-list does not name fails, with one message per file naming the
# file, the line, the include and the layers or the rule.
# cmake -DPYTHON=<python3> -DSCRIPT=<check_layers.py> -DSOURCE=<source tree> -DWORK=<scratch folder> -P <this file>
foreach(var PYTHON SCRIPT SOURCE WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_layers_catches.cmake needs -D${var}=...")
  endif()
endforeach()

set(tree ${WORK}/tree)
file(REMOVE_RECURSE ${tree})
file(MAKE_DIRECTORY ${tree})
file(COPY ${SOURCE}/src ${SOURCE}/include ${SOURCE}/tools DESTINATION ${tree})
file(COPY ${SOURCE}/python/src DESTINATION ${tree}/python)

execute_process(COMMAND ${PYTHON} ${SCRIPT} --root ${tree} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the unmodified copy fails the check (exit ${rc}):\n${out}")
endif()

file(WRITE ${tree}/src/core/upward.cc "// core reaching up into the engine\n\n#include \"engine/engine.hh\"\n")
file(WRITE ${tree}/src/legacy/beside.cc "#include <vector>\n#include \"moe_ep/elastic_buffer.hpp\"\n")
file(WRITE ${tree}/include/moe_ep/leaky.hpp "#pragma once\n#include \"core/log.hh\"\n")
file(WRITE ${tree}/python/src/internal.cc "// the extension reaching past the public headers\n#include \"moe_ep/group.hpp\"\n#include \"comm/transport.hh\"\n")
file(WRITE ${tree}/python/src/mpi/internal.cc "#include \"core/timeout.hh\"\n")
file(WRITE ${tree}/tools/unlisted.cc "#include \"core/timeout.hh\"\n#include \"core/log.hh\"\n")
file(REMOVE ${tree}/tools/cuda_bench_command.cc)  # the one file that includes an allow-listed header
execute_process(COMMAND ${PYTHON} ${SCRIPT} --root ${tree} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "check_layers.py on the modified copy (exit ${rc}):\n${out}")
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "expected exit 1 for a tree with violations, got ${rc}")
endif()
set(expected
    "src/core/upward.cc:3: includes \"engine/engine.hh\" of layer engine from layer core (engine is above core"
    "src/legacy/beside.cc:2: includes \"moe_ep/elastic_buffer.hpp\" of layer elastic from layer legacy (elastic is beside legacy"
    "include/moe_ep/leaky.hpp: public header without a layer"
    "python/src/internal.cc:3: includes \"comm/transport.hh\", which is neither a public header (moe_ep/*.hpp) nor a header of python/src/"
    "python/src/mpi/internal.cc:1: includes \"core/timeout.hh\", which is neither a public header (moe_ep/*.hpp) nor a header of python/src/mpi/"
    "tools/unlisted.cc:2: includes \"core/log.hh\", which is neither a public header (moe_ep/*.hpp) nor a header of tools/"
    "tools/: the allow-list names \"cuda/bench_entry.hh\", which no file of tools/ includes")
foreach(line "python/src/internal.cc:2" "tools/unlisted.cc:1")  # a public header; an allow-listed one
  string(FIND "${out}" "${line}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "an allowed include was reported: ${line}")
  endif()
endforeach()
foreach(line ${expected})
  string(FIND "${out}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "missing from the output: ${line}")
  endif()
endforeach()

# An internal header in a listed public header.
file(REMOVE ${tree}/src/core/upward.cc ${tree}/src/legacy/beside.cc ${tree}/include/moe_ep/leaky.hpp
     ${tree}/python/src/internal.cc ${tree}/python/src/mpi/internal.cc ${tree}/tools/unlisted.cc)
file(COPY ${SOURCE}/tools/cuda_bench_command.cc DESTINATION ${tree}/tools)
file(READ ${tree}/include/moe_ep/group.hpp text)
string(REGEX MATCHALL "\n" newlines "${text}")
list(LENGTH newlines last)
math(EXPR last "${last} + 1")  # the appended line
file(APPEND ${tree}/include/moe_ep/group.hpp "#include \"core/log.hh\"\n")
execute_process(COMMAND ${PYTHON} ${SCRIPT} --root ${tree} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "check_layers.py with an internal header in group.hpp (exit ${rc}):\n${out}")
set(line "include/moe_ep/group.hpp:${last}: public header (layer comm) includes \"core/log.hh\", an internal header")
string(FIND "${out}" "${line}" at)
if(NOT rc EQUAL 1 OR at EQUAL -1)
  message(FATAL_ERROR "expected exit 1 and: ${line}")
endif()
file(REMOVE_RECURSE ${tree})
