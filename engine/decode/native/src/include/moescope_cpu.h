/* The CPU probe the loader asks before it picks a variant library (src/cpu_probe.cpp). */
#ifndef MOESCOPE_CPU_H
#define MOESCOPE_CPU_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
__declspec(dllexport)
#else
__attribute__((visibility("default")))
#endif
const char* moescope_cpu_features(void);

#ifdef __cplusplus
}
#endif

#endif /* MOESCOPE_CPU_H */
