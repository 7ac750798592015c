// Command pulumi-language-python is fimfleet's Python language host for the Pulumi engine.
//
// Pulumi's own host (module sdk/python/cmd/pulumi-language-python/v3) is untagged and
// the module proxy reachable here serves none of its pseudo-versions, so it cannot be
// built offline. This host implements the part of the LanguageRuntime protocol that a
// Python program needs: handshake, plugin info, required packages (none: fimfleet's
// remote steps are dynamic providers), and Run, which starts Pulumi's own
// `pulumi-language-python-exec` (shipped in sdk/v3, installed next to this binary) in
// the project's virtualenv with the engine's config. RunPlugin starts Python plugins,
// which for fimfleet is the CrossGuard policy pack in policy/ (`--policy-pack policy/`).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/pulumi/pulumi/sdk/v3/go/common/util/rpcutil"
	pulumirpc "github.com/pulumi/pulumi/sdk/v3/proto/go"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/emptypb"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "0.0.0-dev"

// bailExitCode is what pulumi-language-python-exec returns after it has already shown
// the user an actionable error; the engine then must not print a second one.
const bailExitCode = 32

type host struct {
	pulumirpc.UnimplementedLanguageRuntimeServer

	mu            sync.Mutex
	engineAddress string
}

func (h *host) Handshake(_ context.Context, req *pulumirpc.LanguageHandshakeRequest,
) (*pulumirpc.LanguageHandshakeResponse, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if req.GetEngineAddress() != "" {
		h.engineAddress = req.GetEngineAddress()
	}
	return &pulumirpc.LanguageHandshakeResponse{}, nil
}

func (h *host) GetPluginInfo(context.Context, *emptypb.Empty) (*pulumirpc.PluginInfo, error) {
	return &pulumirpc.PluginInfo{Version: version}, nil
}

func (h *host) GetRequiredPlugins(context.Context, *pulumirpc.GetRequiredPluginsRequest,
) (*pulumirpc.GetRequiredPluginsResponse, error) {
	return &pulumirpc.GetRequiredPluginsResponse{}, nil
}

func (h *host) GetRequiredPackages(context.Context, *pulumirpc.GetRequiredPackagesRequest,
) (*pulumirpc.GetRequiredPackagesResponse, error) {
	return &pulumirpc.GetRequiredPackagesResponse{}, nil
}

func (h *host) InstallDependencies(*pulumirpc.InstallDependenciesRequest,
	pulumirpc.LanguageRuntime_InstallDependenciesServer,
) error {
	// fimfleet's bootstrap owns the virtualenv; nothing to install here.
	return nil
}

func (h *host) RuntimeOptionsPrompts(context.Context, *pulumirpc.RuntimeOptionsRequest,
) (*pulumirpc.RuntimeOptionsResponse, error) {
	return &pulumirpc.RuntimeOptionsResponse{}, nil
}

func (h *host) GetProgramDependencies(context.Context, *pulumirpc.GetProgramDependenciesRequest,
) (*pulumirpc.GetProgramDependenciesResponse, error) {
	return &pulumirpc.GetProgramDependenciesResponse{}, nil
}

func (h *host) About(_ context.Context, req *pulumirpc.AboutRequest) (*pulumirpc.AboutResponse, error) {
	python := pythonFor(req.GetInfo())
	out, err := exec.Command(python, "--version").Output()
	if err != nil {
		return nil, fmt.Errorf("running %s --version: %w", python, err)
	}
	return &pulumirpc.AboutResponse{
		Executable: python,
		Version:    strings.TrimPrefix(strings.TrimSpace(string(out)), "Python "),
	}, nil
}

func (h *host) Run(ctx context.Context, req *pulumirpc.RunRequest) (*pulumirpc.RunResponse, error) {
	execScript, err := execScriptPath()
	if err != nil {
		return nil, err
	}
	info := req.GetInfo()
	program := req.GetProgram()
	rootDir := ""
	if info != nil {
		program = filepath.Join(info.GetProgramDirectory(), info.GetEntryPoint())
		rootDir = info.GetRootDirectory()
	}
	h.mu.Lock()
	engine := h.engineAddress
	h.mu.Unlock()

	args := []string{
		execScript,
		"--monitor", req.GetMonitorAddress(),
		"--engine", engine,
		"--project", req.GetProject(),
		"--stack", req.GetStack(),
		"--pwd", req.GetPwd(),
		"--dry_run", strconv.FormatBool(req.GetDryRun()),
		"--parallel", strconv.Itoa(int(req.GetParallel())),
		"--organization", req.GetOrganization(),
		"--root_directory", rootDir,
		program,
	}
	args = append(args, req.GetArgs()...)

	// A stack without config must still send "{}": the SDK calls .items() on the decoded value.
	cfg := req.GetConfig()
	if cfg == nil {
		cfg = map[string]string{}
	}
	config, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	secretKeys, err := json.Marshal(nonNil(req.GetConfigSecretKeys()))
	if err != nil {
		return nil, err
	}

	python := pythonFor(info)
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.Dir = req.GetPwd()
	cmd.Stdout = os.Stdout
	cmd.Stderr = os.Stderr
	cmd.Env = append(os.Environ(),
		"PULUMI_CONFIG="+string(config),
		"PULUMI_CONFIG_SECRET_KEYS="+string(secretKeys),
		"PULUMI_PYTHON_CMD="+python,
	)
	if venvBin := filepath.Dir(python); filepath.IsAbs(venvBin) {
		cmd.Env = append(cmd.Env, "PATH="+venvBin+string(os.PathListSeparator)+os.Getenv("PATH"))
	}

	if err := cmd.Run(); err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			if exitErr.ExitCode() == bailExitCode {
				return &pulumirpc.RunResponse{Bail: true}, nil
			}
			return &pulumirpc.RunResponse{
				Error: fmt.Sprintf("Program exited with non-zero exit code: %d", exitErr.ExitCode()),
			}, nil
		}
		return &pulumirpc.RunResponse{Error: err.Error()}, nil
	}
	return &pulumirpc.RunResponse{}, nil
}

// RunPlugin starts a Python plugin the engine launches through this host: a policy pack
// (PulumiPolicy.yaml with runtime python) for `--policy-pack`. Like Pulumi's own host for
// a plain plugin directory, it runs `python <plugin dir> <engine args...>` (the plugin's
// __main__.py) with the engine's environment, in the interpreter that the plugin's
// `virtualenv` option names, and streams its output back: the engine reads the plugin's
// gRPC port from the first stdout line. Cancelling the call (the engine closing the
// plugin) kills the process. Packaged plugins (pyproject.toml without __main__.py,
// started through `pulumi.run.plugin`) are not supported.
func (h *host) RunPlugin(req *pulumirpc.RunPluginRequest, server pulumirpc.LanguageRuntime_RunPluginServer) error {
	info := req.GetInfo()
	dir := info.GetProgramDirectory()
	if _, err := os.Stat(filepath.Join(dir, "__main__.py")); err != nil {
		return fmt.Errorf("fimfleet's Python host runs a plugin from its __main__.py, and %s has none: %w", dir, err)
	}
	python := pythonFor(info)
	cmd := exec.CommandContext(server.Context(), python, append([]string{dir}, req.GetArgs()...)...)
	cmd.Dir = req.GetPwd()
	env := req.GetEnv()
	if len(env) == 0 {
		env = os.Environ()
	}
	if venvBin := filepath.Dir(python); filepath.IsAbs(venvBin) {
		env = append(env, "PATH="+venvBin+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	cmd.Env = env

	closer, stdout, stderr, err := rpcutil.MakeRunPluginStreams(server, false)
	if err != nil {
		return err
	}
	defer closer.Close()
	cmd.Stdout, cmd.Stderr = stdout, stderr

	if err := cmd.Run(); err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			return server.Send(&pulumirpc.RunPluginResponse{
				Output: &pulumirpc.RunPluginResponse_Exitcode{Exitcode: int32(exitErr.ExitCode())},
			})
		}
		return fmt.Errorf("starting plugin %s with %s: %w", dir, python, err)
	}
	return closer.Close()
}

// pythonFor picks the interpreter: Pulumi.yaml's runtime option `virtualenv`
// (relative to the project root), then PULUMI_PYTHON_CMD, then python3 on PATH.
func pythonFor(info *pulumirpc.ProgramInfo) string {
	if info != nil && info.GetOptions() != nil {
		if v, ok := info.GetOptions().AsMap()["virtualenv"].(string); ok && v != "" {
			if !filepath.IsAbs(v) {
				v = filepath.Join(info.GetRootDirectory(), v)
			}
			return filepath.Join(v, "bin", "python")
		}
	}
	if cmd := os.Getenv("PULUMI_PYTHON_CMD"); cmd != "" {
		return cmd
	}
	return "python3"
}

// execScriptPath finds pulumi-language-python-exec beside this binary's real path.
func execScriptPath() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	if resolved, err := filepath.EvalSymlinks(self); err == nil {
		self = resolved
	}
	script := filepath.Join(filepath.Dir(self), "pulumi-language-python-exec")
	if _, err := os.Stat(script); err != nil {
		return "", fmt.Errorf("pulumi-language-python-exec must sit beside %s: %w", self, err)
	}
	return script, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func main() {
	h := &host{}
	// The engine passes its own address as the last positional argument.
	if n := len(os.Args); n > 1 && !strings.HasPrefix(os.Args[n-1], "-") {
		h.engineAddress = os.Args[n-1]
	}
	handle, err := rpcutil.ServeWithOptions(rpcutil.ServeOptions{
		Init: func(srv *grpc.Server) error {
			pulumirpc.RegisterLanguageRuntimeServer(srv, h)
			return nil
		},
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "fatal: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%d\n", handle.Port)
	if err := <-handle.Done; err != nil {
		fmt.Fprintf(os.Stderr, "fatal: %v\n", err)
		os.Exit(1)
	}
}
