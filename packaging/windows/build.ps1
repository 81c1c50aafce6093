# Build the Windows bundle and installer, from the repository root, on Windows:
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1
# Needs: a venv at .venv with torch (CPU or CUDA wheel) and `pip install -e ".[gui]"`, and Inno Setup 6.
# Makes dist\MoEScope\ (MoEScope.exe + moescope-cli.exe) and dist\installer\MoEScope-VERSION-windows-x64-setup.exe.
$ErrorActionPreference = "Stop"
Set-StrictMode -Version Latest
$root = Resolve-Path (Join-Path $PSScriptRoot "..\..")
Set-Location $root
$python = Join-Path $root ".venv\Scripts\python.exe"
& $python -c "import PyInstaller" 2>$null
if ($LASTEXITCODE -ne 0) { & $python -m pip install "pyinstaller>=6.10"; if ($LASTEXITCODE -ne 0) { throw "pip failed" } }
$version = & $python -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])"
& $python -m PyInstaller --noconfirm --distpath dist --workpath build\pyinstaller packaging\moescope.spec
if ($LASTEXITCODE -ne 0) { throw "PyInstaller failed" }
$iscc = Join-Path ${env:ProgramFiles(x86)} "Inno Setup 6\ISCC.exe"
if (-not (Test-Path $iscc)) { throw "Inno Setup 6 not found at $iscc (winget install JRSoftware.InnoSetup)" }
& $iscc "/DAppVersion=$version" packaging\windows\moescope.iss
if ($LASTEXITCODE -ne 0) { throw "ISCC failed" }
$size = (Get-ChildItem -Recurse dist\MoEScope | Measure-Object -Sum Length).Sum / 1MB
Write-Host ("bundle dist\MoEScope: {0:N0} MiB" -f $size)
