// cudasim's NVRTC: a kernel source becomes a host shared object built by the system's C++
// compiler with the kernel prelude in front (kernel_prelude.h), plus one generated wrapper per
// `extern "C" __global__` entry point that copies a launch's arguments (`kilnsim_bind_<name>`).
// The "PTX" handed back names that object; the simulated driver loads it.
//
// Two rewrites make CUDA C host C++: `extern __shared__ T name[];` (dynamic shared memory)
// becomes a pointer to the block's buffer, and the entry points get their wrappers. Everything
// else is the prelude's macros and functions. Objects are cached by the hash of what was
// compiled, under KILN_CUDASIM_CACHE (default: a folder in the temporary directory).
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "sim.h"

namespace {

const char* kPrelude =
#include "kernel_prelude.inc"
    ;

struct Program {
    std::string source, name, log, image;
};

// The source without comments (string literals kept), for reading signatures.
std::string strip_comments(const std::string& s) {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size(); i++) {
        if (s[i] == '"') {
            size_t j = i + 1;
            while (j < s.size() && s[j] != '"') j += s[j] == '\\' ? 2 : 1;
            out.append(s, i, j - i + 1);
            i = j;
        } else if (s.compare(i, 2, "//") == 0) {
            while (i < s.size() && s[i] != '\n') i++;
            out.push_back('\n');
        } else if (s.compare(i, 2, "/*") == 0) {
            const size_t end = s.find("*/", i + 2);
            i = end == std::string::npos ? s.size() : end + 1;
            out.push_back(' ');
        } else {
            out.push_back(s[i]);
        }
    }
    return out;
}

std::string trim(const std::string& s) {
    const size_t a = s.find_first_not_of(" \t\r\n");
    if (a == std::string::npos) return "";
    const size_t b = s.find_last_not_of(" \t\r\n");
    return s.substr(a, b - a + 1);
}

// `extern "C" void* kilnsim_bind_<name>(void** p)` for every entry point: each argument copied
// out of the launch's parameter array into a closure that calls the kernel.
bool wrappers(const std::string& source, std::string& out, std::string& log) {
    const std::string text = strip_comments(source);
    const std::regex entry(
        R"(extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\))");
    int found = 0;
    for (std::sregex_iterator it(text.begin(), text.end(), entry), end; it != end; ++it) {
        const std::string name = (*it)[1];
        std::vector<std::string> params;
        std::stringstream list((*it)[2].str());
        std::string p;
        while (std::getline(list, p, ',')) {
            p = trim(p);
            if (!p.empty() && p != "void") params.push_back(p);
        }
        std::string bind = "extern \"C\" __attribute__((visibility(\"default\"))) void* kilnsim_bind_" +
                           name + "(void** p) {\n";
        std::string args;
        for (size_t i = 0; i < params.size(); i++) {
            std::string type = std::regex_replace(params[i], std::regex(R"(\b__restrict__\b)"), "");
            const std::smatch m = [&] {
                std::smatch m;
                std::regex_search(type, m, std::regex(R"((\w+)\s*$)"));
                return m;
            }();
            if (m.empty()) {
                log += "cudasim: cannot read parameter '" + params[i] + "' of " + name + "\n";
                return false;
            }
            type = trim(type.substr(0, (size_t)m.position(0)));
            const std::string a = "a" + std::to_string(i);
            bind += "    " + type + " " + a + " = *reinterpret_cast<" + type + "*>(p[" +
                    std::to_string(i) + "]);\n";
            args += (i ? ", " : "") + a;
        }
        bind += "    return new std::function<void()>([=]() { " + name + "(" + args + "); });\n}\n";
        out += bind;
        found++;
    }
    if (found == 0) log += "cudasim: no extern \"C\" __global__ entry point found\n";
    return found > 0;
}

std::string cache_dir() {
    if (const char* d = std::getenv("KILN_CUDASIM_CACHE")) return d;
    const char* tmp = std::getenv("TMPDIR");
    return std::string(tmp ? tmp : "/tmp") + "/kiln-cudasim-" + std::to_string(getuid());
}

bool compile(Program& p) {
    std::string body = std::regex_replace(
        p.source,
        std::regex(R"(extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;)"),
        "$1* $2 = reinterpret_cast<$1*>(kilnsim::dynamic_smem);");
    std::string wrap;
    if (!wrappers(p.source, wrap, p.log)) return false;
    const std::string full = std::string(kPrelude) + "\n" + body + "\n" + wrap;
    const std::string dir = cache_dir();
    mkdir(dir.c_str(), 0700);
    const char* cxx = std::getenv("CXX");
    const std::string compiler = std::string(cxx && *cxx ? cxx : "c++") +
                                 " -std=c++17 -O2 -g0 -fPIC -shared -w -fno-strict-aliasing";
    const std::string key = std::to_string(std::hash<std::string>{}(compiler + "\n" + full));
    const std::string so = dir + "/" + key + ".so";
    struct stat st {};
    if (stat(so.c_str(), &st) == 0) {
        p.image = "//cudasim-module:" + so + "\n";
        return true;
    }
    // Ranks open their GPUs at once: each compile writes files of its own before the rename.
    static std::atomic<unsigned long> compiles{0};
    const std::string unique = std::to_string(getpid()) + "-" + std::to_string(compiles++);
    const std::string src = dir + "/" + key + "." + unique + ".cpp";
    const std::string tmp_so = so + "." + unique;
    const std::string errors = src + ".log";
    std::ofstream(src) << full;
    const std::string cmd = compiler + " -o '" + tmp_so + "' '" + src + "' 2> '" + errors + "'";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(errors);
    std::stringstream log;
    log << in.rdbuf();
    unlink(errors.c_str());
    if (rc != 0) {
        p.log += "cudasim: `" + cmd + "` failed (source kept at " + src + "):\n" + log.str();
        unlink(tmp_so.c_str());
        return false;
    }
    unlink(src.c_str());
    rename(tmp_so.c_str(), so.c_str());
    p.image = "//cudasim-module:" + so + "\n";
    return true;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

// nvrtcResult: 0 success, 3 invalid input, 4 invalid program, 6 compilation failed.
API int nvrtcVersion(int* major, int* minor) {
    *major = 13;
    *minor = 0;
    return 0;
}

API int nvrtcCreateProgram(Program** prog, const char* src, const char* name, int, const char* const*,
                           const char* const*) {
    if (!prog || !src) return 3;
    *prog = new Program{src, name ? name : "kernel", "", ""};
    return 0;
}

API int nvrtcDestroyProgram(Program** prog) {
    if (!prog) return 4;
    delete *prog;
    *prog = nullptr;
    return 0;
}

API int nvrtcCompileProgram(Program* prog, int n, const char* const* options) {
    if (!prog) return 4;
    for (int i = 0; i < n; i++) {
        // What NVRTC would refuse, so an option kiln passes is one the real NVRTC takes.
        const std::string o = options[i];
        if (o.rfind("--gpu-architecture=", 0) == 0 || o.rfind("-arch=", 0) == 0) {
            if (o.find("compute_") == std::string::npos && o.find("sm_") == std::string::npos) {
                prog->log += "cudasim: unknown architecture option " + o + "\n";
                return 6;
            }
        }
    }
    return compile(*prog) ? 0 : 6;
}

API int nvrtcGetPTXSize(Program* prog, size_t* size) {
    if (!prog) return 4;
    *size = prog->image.size() + 1;
    return 0;
}

API int nvrtcGetPTX(Program* prog, char* ptx) {
    if (!prog) return 4;
    std::memcpy(ptx, prog->image.c_str(), prog->image.size() + 1);
    return 0;
}

API int nvrtcGetProgramLogSize(Program* prog, size_t* size) {
    if (!prog) return 4;
    *size = prog->log.size() + 1;
    return 0;
}

API int nvrtcGetProgramLog(Program* prog, char* log) {
    if (!prog) return 4;
    std::memcpy(log, prog->log.c_str(), prog->log.size() + 1);
    return 0;
}

API const char* nvrtcGetErrorString(int r) {
    return r == 0 ? "NVRTC_SUCCESS" : r == 6 ? "NVRTC_ERROR_COMPILATION" : "NVRTC_ERROR";
}
