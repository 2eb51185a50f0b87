//! Builds the m40llm C/CUDA library from `c/sources.txt` (the list CMake reads too).
//!
//! Writes only into `OUT_DIR`. Never probes a GPU. Environment variables read (each one is
//! declared with `rerun-if-env-changed`):
//!
//! * `NVCC` — path of the nvcc to use (else `CUDA_PATH`/`CUDA_HOME`/`CUDA_ROOT` `/bin/nvcc`,
//!   `/usr/local/cuda/bin/nvcc`, then `nvcc` on `PATH`).
//! * `NVCC_CCBIN` — host compiler for nvcc (else, for nvcc < 12: the Debian `g++` wrapper next to
//!   the real nvcc binary, then `g++-11`, `g++-10`, `g++-9`, `clang++-14` on `PATH`).
//! * `M40LLM_CUDA_ARCHS` — architectures, comma/semicolon/space separated. `52` = sm_52 SASS +
//!   compute_52 PTX; `sm_52` or `52-real` = SASS only; `compute_52` or `52-virtual` = PTX only.
//!   Default `52,sm_80,sm_90`: the Tesla M40 (any newer GPU can JIT-compile its PTX) plus native
//!   code for Ampere (sm_80, its tensor-core path also runs on sm_86/sm_89) and Hopper (sm_90),
//!   each only when the toolkit can build it.
//! * `CUDA_COMPUTE_CAP` — the variable candle and cudarc users already set: one compute
//!   capability or a list (`86`, `8.6`, `52,90`), each built as SASS + PTX. Used when
//!   `M40LLM_CUDA_ARCHS` is unset.
//! * `M40LLM_NO_CUDA=1` — build the CPU-only library even when a toolkit is installed.
//! * `M40LLM_LIB_DIR` — an absolute path: link the `libm40llm.a` of a CMake build of the same
//!   version instead of compiling: its build directory, or the `lib` directory of its install.
//!   What it was built with (CUDA or not, the architectures, its C++ runtime) is read from the
//!   CMake package files beside it (`m40llmConfig.cmake`, `m40llmConfigVersion.cmake`,
//!   `m40llmLinkDeps.cmake`); with CUDA, `libcudart_static.a` comes from the toolkit found as
//!   above. The architecture and `M40LLM_NO_CUDA` variables then do not apply.
//! * `DOCS_RS` — set: build nothing (docs need only the committed bindings).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;

const ENV_VARS: &[&str] = &[
    "NVCC",
    "NVCC_CCBIN",
    "CUDA_PATH",
    "CUDA_HOME",
    "CUDA_ROOT",
    "PATH",
    "M40LLM_CUDA_ARCHS",
    "CUDA_COMPUTE_CAP",
    "M40LLM_NO_CUDA",
    "M40LLM_LIB_DIR",
    "DOCS_RS",
];

const SETUP_HELP: &str =
    "install a CUDA toolkit that can target sm_52 (CUDA 11.8; on Debian/Ubuntu \
    run scripts/setup.sh from the m40llm repository, which installs nvidia-cuda-toolkit and \
    g++-11), or point NVCC (or CUDA_PATH) at an existing nvcc";

fn main() {
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    // The crate sees the repository's c/ and cuda/ through the symlinks rust/m40llm-sys/c and
    // rust/m40llm-sys/cuda (followed by `cargo package`, so a packaged crate holds real copies).
    let root = manifest_dir.clone();
    let include_dir = root.join("c").join("include");
    println!("cargo:include={}", include_dir.display());

    #[cfg(feature = "regenerate-bindings")]
    generate_bindings(&include_dir);

    if env::var_os("DOCS_RS").is_some() {
        println!("cargo:cuda=0");
        return;
    }
    if let Some(dir) = env::var_os("M40LLM_LIB_DIR").filter(|d| !d.is_empty()) {
        link_prebuilt(Path::new(&dir));
        return;
    }

    let sources = read_sources(&root);
    emit_rerun_for_tree(&root, &sources);

    let want_cuda = cfg!(feature = "cuda");
    let no_cuda = env_flag("M40LLM_NO_CUDA");
    if want_cuda && no_cuda {
        panic!("m40llm-sys: the `cuda` feature is enabled but M40LLM_NO_CUDA=1 disables CUDA");
    }

    let toolkit = if no_cuda { None } else { find_toolkit() };
    if !no_cuda {
        watch_toolkit_locations(toolkit.as_ref());
    }
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));

    let mut c_build = cc::Build::new();
    c_build
        .std("c11")
        .include(root.join("c/include"))
        .include(root.join("c/src"))
        .include(root.join("cuda"))
        .warnings(true)
        .extra_warnings(true);

    match toolkit {
        None => {
            if want_cuda {
                panic!(
                    "m40llm-sys: the `cuda` feature is enabled but no CUDA toolkit (nvcc) was \
                     found: {SETUP_HELP}."
                );
            }
            if !no_cuda {
                println!(
                    "cargo:warning=m40llm-sys: built WITHOUT CUDA, CPU backend only: nvcc was not \
                     found (NVCC, CUDA_PATH/CUDA_HOME/CUDA_ROOT, /usr/local/cuda/bin, PATH). \
                     To get the GPU backend, {SETUP_HELP}; a toolkit that appears in one of those \
                     places is picked up by the next build (or run `cargo clean -p m40llm-sys`). \
                     Enable the `cuda` feature to make this an error, or set M40LLM_NO_CUDA=1 to \
                     silence it."
                );
            }
            for s in sources.iter().filter(|s| s.group == "common") {
                c_build.file(&s.path);
            }
            c_build.compile("m40llm");
            println!("cargo:cuda=0");
        }
        Some(tk) => {
            let (archs_var, archs_spec) = arch_spec(&tk.nvcc);
            let archs = parse_archs(&archs_spec).unwrap_or_else(|e| {
                panic!("m40llm-sys: bad {archs_var}={archs_spec:?}: {e}");
            });
            let archs_reported = cmake_form(&archs);
            let ccbin = find_ccbin(&tk);

            // cc's CUDA mode runs the nvcc named by NVCC. Build scripts run single-threaded,
            // so setting it for this process is fine.
            env::set_var("NVCC", &tk.nvcc);

            // Each .cu file is compiled on its own (whole-program, no relocatable device
            // code), exactly like CMake's default: cc compiles several CUDA files of one Build
            // with --device-c, and PTX-only builds of relocatable code do not JIT-load. So one
            // Build a file, run on NUM_JOBS threads (cargo's -j): serially, the instance files
            // alone took minutes with the default four architectures.
            let compile_cu = |i: usize, s: &Source| {
                let mut b = cc::Build::new();
                b.cuda(true)
                    .cudart("none")
                    .ccbin(false)
                    .debug(false) // cc would pass -G, which disables device optimisation
                    .opt_level(3)
                    .out_dir(out_dir.join(format!("cu{i}")))
                    .include(root.join("c/include"))
                    .include(root.join("c/src"))
                    .include(root.join("cuda"))
                    .define("M40LLM_HAVE_CUDA", "1")
                    // What m40llm_build_info reports; CMake defines the same, in the same form.
                    .define(
                        "M40LLM_CUDA_ARCHITECTURES",
                        format!("\"{archs_reported}\"").as_str(),
                    )
                    .flag("-std=c++17");
                if let Some(cc) = &ccbin {
                    b.flag("-ccbin")
                        .flag(cc.to_str().expect("utf-8 ccbin path"));
                }
                for a in &archs {
                    b.flag(a.gencode());
                }
                b.file(&s.path);
                b.compile_intermediates()
            };
            let cu_sources: Vec<&Source> = sources.iter().filter(|s| s.group == "cuda").collect();
            let cu_objects = in_parallel(&cu_sources, |i, s| compile_cu(i, s));

            c_build.define("M40LLM_HAVE_CUDA", "1");
            for s in sources.iter().filter(|s| s.group == "common") {
                c_build.file(&s.path);
            }
            c_build.objects(&cu_objects);
            c_build.compile("m40llm");

            link_cudart(&tk);
            println!("cargo:rustc-link-lib=dylib=pthread");
            // nvcc's host side is C++ (g++): its objects may need the C++ runtime.
            println!("cargo:rustc-link-lib=dylib=stdc++");
            println!("cargo:cuda=1");
            println!("cargo:cuda_archs={archs_reported}");
        }
    }
    println!("cargo:rustc-link-lib=dylib=m");
}

/// Links the static library of a CMake build (`M40LLM_LIB_DIR`): the archive, and what its
/// CMake package files say it needs.
fn link_prebuilt(dir: &Path) {
    let fail =
        |what: String| -> ! { panic!("m40llm-sys: M40LLM_LIB_DIR={}: {what}", dir.display()) };
    const WHERE: &str =
        "(expected a CMake build directory of m40llm, or the lib directory of its install)";
    if !dir.is_absolute() {
        fail("not an absolute path (a build script runs in the crate's directory)".into());
    }
    let lib = dir.join("libm40llm.a");
    if !lib.is_file() {
        fail(format!("no libm40llm.a there {WHERE}"));
    }
    let package = [dir.to_path_buf(), dir.join("cmake").join("m40llm")]
        .into_iter()
        .find(|d| d.join("m40llmConfig.cmake").is_file())
        .unwrap_or_else(|| fail(format!("no m40llmConfig.cmake beside libm40llm.a {WHERE}")));
    let read = |name: &str| -> String {
        let path = package.join(name);
        println!("cargo:rerun-if-changed={}", path.display());
        fs::read_to_string(&path)
            .unwrap_or_else(|e| fail(format!("cannot read {}: {e}", path.display())))
    };
    let config = read("m40llmConfig.cmake");
    let version = read("m40llmConfigVersion.cmake");
    let deps = read("m40llmLinkDeps.cmake");
    println!("cargo:rerun-if-changed={}", lib.display());

    let want = env::var("CARGO_PKG_VERSION").expect("CARGO_PKG_VERSION");
    let have = cmake_set(&version, "PACKAGE_VERSION").unwrap_or_default();
    if have != want {
        fail(format!(
            "the library is version {have:?}, these bindings are for {want}"
        ));
    }
    if cmake_set(&config, "m40llm_SHARED").as_deref() != Some("OFF") {
        fail("the library is not a static archive (BUILD_SHARED_LIBS)".into());
    }
    let cuda = cmake_set(&config, "m40llm_WITH_CUDA").as_deref() == Some("ON");
    if cfg!(feature = "cuda") && !cuda {
        fail("the `cuda` feature is enabled but the library was built without CUDA".into());
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=static=m40llm");
    if cuda {
        let tk = find_toolkit().unwrap_or_else(|| {
            fail(format!(
                "the library was built with CUDA and needs libcudart_static.a, but no CUDA \
                 toolkit was found: {SETUP_HELP}"
            ))
        });
        watch_toolkit_locations(Some(&tk));
        link_cudart(&tk);
        let archs = cmake_set(&config, "m40llm_CUDA_ARCHITECTURES").unwrap_or_default();
        println!("cargo:cuda=1");
        println!("cargo:cuda_archs={archs}");
    } else {
        println!("cargo:cuda=0");
    }
    for runtime in cmake_set(&deps, "M40LLM_CXX_RUNTIME_LIBS")
        .unwrap_or_default()
        .split(';')
        .filter(|l| !l.is_empty())
    {
        println!(
            "cargo:rustc-link-lib=dylib={}",
            runtime.trim_start_matches("-l")
        );
    }
    println!("cargo:rustc-link-lib=dylib=pthread");
    println!("cargo:rustc-link-lib=dylib=m");
}

/// Links the toolkit's static CUDA runtime and what it needs (`dl`, `rt`).
fn link_cudart(tk: &Toolkit) {
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let dir = find_cudart_dir(tk, &target_arch).unwrap_or_else(|| {
        panic!(
            "m40llm-sys: found nvcc at {} but no libcudart_static.a next to it \
             (looked in lib64, targets/*/lib, /usr/lib/<arch>-linux-gnu)",
            tk.nvcc.display()
        )
    });
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-lib=dylib=rt");
}

/// The value of `set(NAME "value")` or `set(NAME value)` in a CMake file, unquoted.
fn cmake_set(text: &str, name: &str) -> Option<String> {
    let prefix = format!("set({name} ");
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.strip_suffix(')'))
        .map(|v| v.trim().trim_matches('"').to_string())
}

fn env_flag(name: &str) -> bool {
    matches!(
        env::var(name).as_deref(),
        Ok("1") | Ok("true") | Ok("yes") | Ok("on")
    )
}

/// `f(i, item)` for every item, on up to NUM_JOBS threads (cargo's -j) taking the items in
/// order (c/sources.txt lists the slowest first); the results in item order. A panic in `f`
/// (cc's way to fail a build) fails the build script.
fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> Vec<R> + Sync) -> Vec<R> {
    let jobs = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, items.len().max(1));
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::new());
    thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let out = f(i, item);
                done.lock().expect("no panic while locked").push((i, out));
            });
        }
    });
    let mut done = done.into_inner().expect("no panic while locked");
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().flat_map(|(_, out)| out).collect()
}

struct Source {
    group: String,
    path: PathBuf,
}

fn read_sources(root: &Path) -> Vec<Source> {
    let list = root.join("c").join("sources.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    let text = fs::read_to_string(&list)
        .unwrap_or_else(|e| panic!("m40llm-sys: cannot read {}: {e}", list.display()));
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (group, path) = line
            .split_once(char::is_whitespace)
            .unwrap_or_else(|| panic!("{}:{}: expected \"GROUP PATH\"", list.display(), n + 1));
        let group = group.to_string();
        if !matches!(group.as_str(), "common" | "cuda") {
            panic!("{}:{}: unknown group {group:?}", list.display(), n + 1);
        }
        let path = root.join(path.trim());
        if !path.is_file() {
            panic!(
                "{}:{}: missing source {}",
                list.display(),
                n + 1,
                path.display()
            );
        }
        out.push(Source { group, path });
    }
    out
}

fn emit_rerun_for_tree(root: &Path, sources: &[Source]) {
    for s in sources {
        println!("cargo:rerun-if-changed={}", s.path.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("c/include/m40llm.h").display()
    );
    for dir in [root.join("c/src"), root.join("cuda")] {
        // The directory itself, so added files re-run the build too.
        println!("cargo:rerun-if-changed={}", dir.display());
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        let mut headers: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("h" | "cuh")))
            .collect();
        headers.sort();
        for h in headers {
            println!("cargo:rerun-if-changed={}", h.display());
        }
    }
}

struct Toolkit {
    /// The nvcc to invoke (may be a wrapper script, as Debian's /usr/bin/nvcc is).
    nvcc: PathBuf,
    /// The nvcc binary behind wrappers and symlinks.
    real_nvcc: PathBuf,
    major: u32,
}

/// Where nvcc is looked for, in order, before `PATH`: `NVCC`, `CUDA_PATH`/`CUDA_HOME`/
/// `CUDA_ROOT` `/bin/nvcc`, `/usr/local/cuda/bin/nvcc`.
fn toolkit_candidates() -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        candidates.push(PathBuf::from(p));
    }
    for var in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(r) = env::var_os(var).filter(|p| !p.is_empty()) {
            candidates.push(PathBuf::from(r).join("bin").join("nvcc"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates
}

fn find_toolkit() -> Option<Toolkit> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !is_executable(&p) {
            panic!("m40llm-sys: NVCC={} is not an executable file", p.display());
        }
    }
    let mut candidates = toolkit_candidates();
    if let Some(p) = which("nvcc") {
        candidates.push(p);
    }
    let nvcc = candidates.into_iter().find(|p| is_executable(p))?;
    let out = Command::new(&nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("m40llm-sys: cannot run {} --version: {e}", nvcc.display()));
    if !out.status.success() {
        panic!("m40llm-sys: {} --version failed", nvcc.display());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let major = text
        .split("release ")
        .nth(1)
        .and_then(|r| r.split('.').next())
        .and_then(|m| m.trim().parse::<u32>().ok())
        .unwrap_or_else(|| panic!("m40llm-sys: cannot parse the version of {}", nvcc.display()));
    let real_nvcc = resolve_wrapper(&nvcc);
    Some(Toolkit {
        nvcc,
        real_nvcc,
        major,
    })
}

/// Follows symlinks and one level of `exec /path/to/nvcc "$@"` shell wrapper (Debian's
/// /usr/bin/nvcc) to the real nvcc binary.
fn resolve_wrapper(nvcc: &Path) -> PathBuf {
    let canon = fs::canonicalize(nvcc).unwrap_or_else(|_| nvcc.to_path_buf());
    let Ok(bytes) = fs::read(&canon) else {
        return canon;
    };
    if bytes.len() > 4096 || !bytes.starts_with(b"#!") {
        return canon;
    }
    let text = String::from_utf8_lossy(&bytes);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() == Some("exec") {
            if let Some(target) = words.next() {
                let target = Path::new(target.trim_matches('"'));
                if target.is_absolute()
                    && target.file_name() == Some("nvcc".as_ref())
                    && is_executable(target)
                {
                    return fs::canonicalize(target).unwrap_or_else(|_| target.to_path_buf());
                }
            }
        }
    }
    canon
}

fn find_ccbin(tk: &Toolkit) -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC_CCBIN").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if tk.major >= 12 {
        return None;
    }
    // Debian's toolkit ships a g++ wrapper next to the real nvcc that picks a supported GCC.
    if let Some(dir) = tk.real_nvcc.parent() {
        let general = [
            Path::new("/usr/bin"),
            Path::new("/usr/local/bin"),
            Path::new("/bin"),
        ];
        let wrapper = dir.join("g++");
        if !general.contains(&dir) && is_executable(&wrapper) {
            return Some(wrapper);
        }
    }
    for name in ["g++-11", "g++-10", "g++-9", "clang++-14"] {
        if let Some(p) = which(name) {
            return Some(p);
        }
    }
    println!(
        "cargo:warning=m40llm-sys: nvcc {} may reject the default host compiler; set NVCC_CCBIN \
         to g++-11 or older",
        tk.major
    );
    None
}

/// Which architectures to build, and the variable they came from: `M40LLM_CUDA_ARCHS`, else
/// `CUDA_COMPUTE_CAP` (candle's convention: `86`, `8.6`, `52,90`), else [`default_archs`].
fn arch_spec(nvcc: &Path) -> (&'static str, String) {
    let set = |name: &str| env::var(name).ok().filter(|s| !s.trim().is_empty());
    if let Some(spec) = set("M40LLM_CUDA_ARCHS") {
        return ("M40LLM_CUDA_ARCHS", spec);
    }
    if let Some(caps) = set("CUDA_COMPUTE_CAP") {
        // "8.6" (nvidia-smi --query-gpu=compute_cap) is 86; each one is SASS + PTX.
        let spec = caps
            .split([',', ';', ' ', '\t'])
            .filter(|s| !s.is_empty())
            .map(|c| c.replace('.', ""))
            .collect::<Vec<_>>()
            .join(",");
        return ("CUDA_COMPUTE_CAP", spec);
    }
    ("the default architecture list", default_archs(nvcc))
}

/// The default: sm_52 SASS + compute_52 PTX (the M40; newer GPUs JIT the PTX) plus sm_80 and
/// sm_90 SASS, so Ampere and Hopper run native code with the tensor-core path. Each only when
/// this nvcc can build it; when it can no longer target the M40, the lowest architecture it can
/// build takes sm_52's place.
fn default_archs(nvcc: &Path) -> String {
    let archs: Vec<u32> = match Command::new(nvcc).arg("--list-gpu-arch").output() {
        Ok(out) if out.status.success() => {
            let mut a: Vec<u32> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|w| w.strip_prefix("compute_"))
                .filter_map(|n| n.parse().ok())
                .collect();
            a.sort_unstable();
            a
        }
        // nvcc older than 11.0 has no --list-gpu-arch: the M40 alone.
        _ => return "52".into(),
    };
    if archs.is_empty() {
        return "52".into();
    }
    let base = if archs.contains(&52) {
        52
    } else {
        println!(
            "cargo:warning=m40llm-sys: this CUDA toolkit cannot build sm_52 (the M40); building \
             for sm_{0} instead. Use CUDA 11.8 for M40 support or set M40LLM_CUDA_ARCHS.",
            archs[0]
        );
        archs[0]
    };
    let mut spec = base.to_string();
    for sass in [80, 90] {
        if sass > base && archs.contains(&sass) {
            spec.push_str(&format!(",sm_{sass}"));
        }
    }
    spec
}

/// Makes cargo re-run this script when the toolkit changes or appears. Found: the nvcc used
/// (and the binary behind a wrapper). Not found: the nearest existing directory above each
/// place [`find_toolkit`] looks (`/usr/local` for `/usr/local/cuda/bin/nvcc`) and the `PATH`
/// directories. Cargo re-runs a build script on every build while a watched path is missing, so
/// only existing paths are named, and never `/`.
fn watch_toolkit_locations(found: Option<&Toolkit>) {
    let mut watch: Vec<PathBuf> = Vec::new();
    if let Some(tk) = found {
        watch.push(tk.nvcc.clone());
        watch.push(tk.real_nvcc.clone());
    } else {
        for c in toolkit_candidates() {
            if let Some(dir) = c.ancestors().find(|a| a.is_dir()) {
                watch.push(dir.to_path_buf());
            }
        }
        if let Some(path) = env::var_os("PATH") {
            watch.extend(env::split_paths(&path).filter(|d| d.is_absolute() && d.is_dir()));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for p in watch {
        if p.parent().is_some() && p.exists() && seen.insert(p.clone()) {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
}

/// One architecture of the list: sm_NN SASS, compute_NN PTX, or both.
struct Arch {
    n: u32,
    sass: bool,
    ptx: bool,
}

impl Arch {
    /// Its nvcc `-gencode` flag.
    fn gencode(&self) -> String {
        let n = self.n;
        let code = match (self.sass, self.ptx) {
            (true, true) => format!("[sm_{n},compute_{n}]"),
            (true, false) => format!("sm_{n}"),
            _ => format!("compute_{n}"),
        };
        format!("-gencode=arch=compute_{n},code={code}")
    }
}

/// The list in CMake's CUDA_ARCHITECTURES form, as cmake/cuda_toolkit.cmake writes it for the
/// same list: `NN-real` (SASS) and `NN-virtual` (PTX) entries, sorted, without duplicates
/// (`52,sm_90` is `52-real;52-virtual;90-real`).
fn cmake_form(archs: &[Arch]) -> String {
    let mut entries: Vec<(u32, &str)> = Vec::new();
    for a in archs {
        if a.sass {
            entries.push((a.n, "real"));
        }
        if a.ptx {
            entries.push((a.n, "virtual"));
        }
    }
    entries.sort_unstable();
    entries.dedup();
    entries
        .iter()
        .map(|(n, kind)| format!("{n}-{kind}"))
        .collect::<Vec<_>>()
        .join(";")
}

/// Parses an architecture list (see the module docs for the format).
fn parse_archs(spec: &str) -> Result<Vec<Arch>, String> {
    let mut archs = Vec::new();
    for item in spec.split([',', ';', ' ', '\t']).filter(|s| !s.is_empty()) {
        let num = |s: &str| -> Result<u32, String> {
            s.parse::<u32>().map_err(|_| {
                format!("{item:?} is not NN, sm_NN, compute_NN, NN-real or NN-virtual")
            })
        };
        let (n, sass, ptx) = if let Some(n) = item.strip_prefix("sm_") {
            (num(n)?, true, false)
        } else if let Some(n) = item.strip_prefix("compute_") {
            (num(n)?, false, true)
        } else if let Some(n) = item.strip_suffix("-real") {
            (num(n)?, true, false)
        } else if let Some(n) = item.strip_suffix("-virtual") {
            (num(n)?, false, true)
        } else {
            (num(item)?, true, true)
        };
        archs.push(Arch { n, sass, ptx });
    }
    if archs.is_empty() {
        return Err("no architecture given".into());
    }
    Ok(archs)
}

fn find_cudart_dir(tk: &Toolkit, target_arch: &str) -> Option<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(r) = env::var_os(var).filter(|p| !p.is_empty()) {
            roots.push(PathBuf::from(r));
        }
    }
    for nvcc in [&tk.real_nvcc, &tk.nvcc] {
        if let Some(root) = nvcc.parent().and_then(Path::parent) {
            roots.push(root.to_path_buf());
        }
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut dirs: Vec<PathBuf> = Vec::new();
    for r in &roots {
        dirs.push(r.join("lib64"));
        dirs.push(
            r.join("targets")
                .join(format!("{target_arch}-linux"))
                .join("lib"),
        );
        dirs.push(r.join("lib"));
    }
    // Debian/Ubuntu packages (nvidia-cuda-toolkit) install into the multiarch directory.
    dirs.push(PathBuf::from(format!("/usr/lib/{target_arch}-linux-gnu")));
    dirs.into_iter()
        .find(|d| d.join("libcudart_static.a").is_file())
}

fn which(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(p)
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    }
    #[cfg(not(unix))]
    {
        p.is_file()
    }
}

#[cfg(feature = "regenerate-bindings")]
fn generate_bindings(include_dir: &Path) {
    let header = include_dir.join("m40llm.h");
    // Also under DOCS_RS, where main() returns before declaring the source tree: without this a
    // cached build-script run would hand regen_bindings.sh bindings of an older header.
    println!("cargo:rerun-if-changed={}", header.display());
    let bindings = bindgen::Builder::default()
        .header(header.to_str().expect("utf-8 path"))
        .allowlist_function("m40llm_.*")
        .allowlist_type("m40llm_.*")
        .allowlist_var("M40LLM_.*")
        .rust_target(bindgen::RustTarget::stable(70, 0).expect("rust target"))
        .use_core()
        .prepend_enum_name(false)
        .merge_extern_blocks(true)
        .layout_tests(false)
        .derive_default(true)
        .derive_debug(true)
        .generate_comments(true)
        .formatter(bindgen::Formatter::Prettyplease)
        .raw_line("// Generated by bindgen from c/include/m40llm.h. Do not edit:")
        .raw_line("// run rust/scripts/regen_bindings.sh instead.")
        .generate()
        .expect("bindgen failed on c/include/m40llm.h");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("bindings.rs");
    bindings.write_to_file(&out).expect("write bindings");
}
