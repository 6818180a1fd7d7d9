# cmake -DBUILD_DIR=<build> -DPREFIX=<prefix> [-DCONFIG=<cfg>] -P install.cmake
# Installs the build into an emptied prefix (the consumer_install test of CMakeLists.txt).
file(REMOVE_RECURSE "${PREFIX}")
set(_config)
if(CONFIG)
  set(_config --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${_config}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed: ${rc}")
endif()
