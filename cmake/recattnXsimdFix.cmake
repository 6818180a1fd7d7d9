# Debian 12's xsimd package (libxsimd-dev 8.1) exports a target `xsimd` that links `xtl`
# without finding it, so every link against xsimd fails with "cannot find -lxtl". xsimd
# needs xtl only for XSIMD_ENABLE_XTL_COMPLEX, which recattn does not use: use xtl's
# package when it is installed, else drop the dangling name. Included by recattn's
# CMakeLists.txt and by the installed recattnConfig.cmake, after find_package(xsimd).
if(TARGET xsimd AND NOT TARGET xtl)
  get_target_property(_recattn_xsimd_links xsimd INTERFACE_LINK_LIBRARIES)
  if(_recattn_xsimd_links AND "xtl" IN_LIST _recattn_xsimd_links)
    find_package(xtl CONFIG QUIET)
    if(NOT TARGET xtl)
      list(REMOVE_ITEM _recattn_xsimd_links xtl)
      set_property(TARGET xsimd PROPERTY INTERFACE_LINK_LIBRARIES "${_recattn_xsimd_links}")
    endif()
  endif()
  unset(_recattn_xsimd_links)
endif()
