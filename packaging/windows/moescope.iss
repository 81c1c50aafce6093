; Inno Setup 6 script: MoEScope-VERSION-windows-x64-setup.exe from the PyInstaller bundle.
;
; Built on Windows (PyInstaller does not cross-compile), from the repository root:
;   .venv\Scripts\python -m PyInstaller --noconfirm packaging\moescope.spec      -> dist\MoEScope\
;   "%ProgramFiles(x86)%\Inno Setup 6\ISCC.exe" packaging\windows\moescope.iss    -> dist\installer\
; or packaging\windows\build.ps1, which runs both. Per-user install by default (no administrator
; rights; the user may choose all users), a Start-menu entry, an optional desktop icon, an uninstaller.
; The bundle holds MoEScope.exe (the window, no console) and moescope-cli.exe (the engine CLI).

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#define AppName "MoEScope"
#define AppExe "MoEScope.exe"
#define Root "..\.."

[Setup]
AppId={{E499BA99-1C45-444F-9E26-D100DA0BE980}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=The MoEScope developers
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#Root}\dist\installer
OutputBaseFilename=MoEScope-{#AppVersion}-windows-x64-setup
SetupIconFile={#Root}\packaging\icons\moescope.ico
UninstallDisplayIcon={app}\{#AppExe}
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#Root}\dist\MoEScope\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; Only what the program wrote inside its own folder; the user's chats and settings live elsewhere and stay.
Type: filesandordirs; Name: "{app}\__pycache__"
