;;;; listen.lisp -- listening sockets shared with other processes: taken
;;;; from a supervisor (systemd's socket activation), or bound with
;;;; SO_REUSEPORT beside other processes on the same port.
;;;;
;;;; Socket activation (sd_listen_fds(3)): a supervisor that opened the
;;;; listening sockets itself starts the server with them as fds 3, 4, ...,
;;;; and says so in the environment: LISTEN_FDS (how many), LISTEN_PID (the
;;;; process they are for: a child that inherits the environment ignores
;;;; them) and LISTEN_FDNAMES (their names, separated by colons, from the
;;;; socket units' FileDescriptorName=).  A server claims the one of its
;;;; name, or else the one on its port, and serves on a copy of it instead
;;;; of binding: the socket outlives the server and its process, so a
;;;; restart refuses no connection (they wait in the socket's queue), and
;;;; a server stopped and started again in the process finds it again.
;;;; A server that asks for a port none of the passed sockets is on refuses
;;;; to start, naming both: bound beside them, it would serve a port
;;;; nobody connects to while the supervisor's socket queues connections
;;;; no one accepts (doc/design.md, "A passed socket on another port").
;;;; The passed fds are made close-on-exec when read, as sd_listen_fds does,
;;;; so that no program the server runs holds them open; they are read when
;;;; a server first asks, and again after the image is saved.

(in-package #:gallop.core)

(defconstant +so-type+ 3)
(defconstant +so-reuseport+ 15)
(defconstant +so-acceptconn+ 30)
(defconstant +sock-stream+ 1)
(defconstant +f-setfd+ 2)
(defconstant +fd-cloexec+ 1)
(defconstant +listen-fds-start+ 3
  "The first fd a supervisor passes (SD_LISTEN_FDS_START).")

(defun socket-int-option (fd level name)
  "The int value of the socket option NAME at LEVEL of FD, or NIL when
getsockopt(2) fails (FD is not a socket)."
  (sb-alien:with-alien ((value sb-alien:int 0)
                        (length (sb-alien:unsigned 32) 4))
    (and (zerop (%getsockopt fd level name (sb-alien:alien-sap (sb-alien:addr value))
                             (sb-alien:alien-sap (sb-alien:addr length))))
         value)))

(defun set-reuse-port (fd)
  "Set SO_REUSEPORT on the socket FD, before it is bound: processes that all
set it may bind the same address and port, and the kernel spreads new
connections across their listening sockets."
  (sb-alien:with-alien ((on sb-alien:int 1))
    (unless (zerop (%setsockopt fd +sol-socket+ +so-reuseport+
                                (sb-alien:alien-sap (sb-alien:addr on)) 4))
      (error "setsockopt(SO_REUSEPORT) failed: errno ~D" (%errno)))))

(defun socket-family-and-port (fd)
  "The address family of the socket FD (2: IPv4, 10: IPv6, 1: local...)
and its port (for IPv4 and IPv6), or NIL when FD is not a socket."
  (sb-alien:with-alien ((addr (array (sb-alien:unsigned 8) 128))
                        (len (sb-alien:unsigned 32) 128))
    (let ((sap (sb-alien:alien-sap addr)))
      (when (zerop (%getsockname fd sap (sb-alien:alien-sap (sb-alien:addr len))))
        (values (sb-sys:sap-ref-16 sap 0)
                (logior (ash (sb-sys:sap-ref-8 sap 2) 8) (sb-sys:sap-ref-8 sap 3)))))))

(defun socket-address-string (fd)
  "The address and port the socket FD is bound to, as \"127.0.0.1:8080\" or
\"[::1]:8080\", or \"fd N\" when FD is not an IPv4 or IPv6 socket."
  (sb-alien:with-alien ((addr (array (sb-alien:unsigned 8) 128))
                        (len (sb-alien:unsigned 32) 128))
    (let ((sap (sb-alien:alien-sap addr)))
      (flet ((octets (start count)
               (loop for i from start below (+ start count) collect (sb-sys:sap-ref-8 sap i))))
        (multiple-value-bind (family port) (socket-family-and-port fd)
          (if (and (eql 0 (%getsockname fd sap (sb-alien:alien-sap (sb-alien:addr len))))
                   (member family '(2 10)))
              (if (= family 2)
                  (format nil "~{~D~^.~}:~D" (octets 4 4) port)
                  (format nil "[~{~(~2,'0x~2,'0x~)~^:~}]:~D" (octets 8 16) port))
              (format nil "fd ~D" fd)))))))

(defun listening-tcp-socket-p (fd)
  "True when FD is an IPv4 or IPv6 stream socket that listens."
  (and (member (socket-family-and-port fd) '(2 10))
       (eql +sock-stream+ (socket-int-option fd +sol-socket+ +so-type+))
       (eql 1 (socket-int-option fd +sol-socket+ +so-acceptconn+))))

(defstruct (activated-socket (:constructor make-activated-socket (fd name port)) (:copier nil))
  "A listening socket a supervisor passed this process."
  (fd 0 :type fixnum :read-only t)
  (name nil :read-only t)               ; from LISTEN_FDNAMES, or NIL
  (port 0 :type fixnum :read-only t)    ; the port it listens on
  (claimed nil))                        ; a server serves on a copy of it

(sb-ext:define-load-time-global *activated-sockets* :unread
  "This process's ACTIVATED-SOCKETs, read from the environment on first use
\(READ-ACTIVATED-SOCKETS), or :UNREAD.")

(sb-ext:define-load-time-global *activated-sockets-lock*
    (sb-thread:make-mutex :name "gallop activated sockets"))

(defun forget-activated-sockets ()
  "Read the passed sockets again when next asked: a saved image starts in
another process, with an environment of its own."
  (setf *activated-sockets* :unread))

(pushnew 'forget-activated-sockets sb-ext:*save-hooks*)

(defun split-names (string)
  "STRING's parts between colons."
  (loop for start = 0 then (1+ end)
        for end = (or (position #\: string :start start) (length string))
        collect (subseq string start end)
        while (< end (length string))))

(defun parse-listen-environment (pid fds names own-pid)
  "The (FD NAME) pairs that the values PID, FDS and NAMES of LISTEN_PID,
LISTEN_FDS and LISTEN_FDNAMES (strings or NIL) pass to the process OWN-PID:
none unless PID is OWN-PID and FDS a positive count; NAME NIL when NAMES
does not name that many."
  (let ((pid (and pid (parse-integer pid :junk-allowed t)))
        (count (and fds (parse-integer fds :junk-allowed t)))
        (names (and names (split-names names))))
    (when (and (eql pid own-pid) count (plusp count))
      (loop for i below count
            collect (list (+ +listen-fds-start+ i)
                          (and (= (length names) count) (nth i names)))))))

(defun read-activated-sockets ()
  "The listening TCP sockets the environment says a supervisor passed this
process.  Every fd passed is made close-on-exec; those that are not
listening TCP sockets (a supervisor may pass others) are otherwise left
alone."
  (loop for (fd name) in (parse-listen-environment (sb-ext:posix-getenv "LISTEN_PID")
                                                   (sb-ext:posix-getenv "LISTEN_FDS")
                                                   (sb-ext:posix-getenv "LISTEN_FDNAMES")
                                                   (sb-unix:unix-getpid))
        do (%fcntl fd +f-setfd+ +fd-cloexec+)
        when (listening-tcp-socket-p fd)
          collect (make-activated-socket fd name (nth-value 1 (socket-family-and-port fd)))))

(defun claim-activated-socket (&key name port address)
  "A copy (a new fd, close-on-exec) of a listening socket a supervisor passed
this process (socket activation, see listen.lisp) that no server claimed,
now claimed until RELEASE-ACTIVATED-SOCKET: the one named NAME when given,
else the one on PORT (any, when PORT is 0 or NIL).  NIL when none was
passed, or when the one of NAME or on PORT is missing or claimed.  An
error when sockets were passed but none is on PORT (not 0 or NIL, no NAME):
its one-line message names them and ADDRESS:PORT, the server asked for."
  (let ((passed-elsewhere '()))
    (sb-thread:with-mutex (*activated-sockets-lock*)
      (when (eq *activated-sockets* :unread)
        (setf *activated-sockets* (read-activated-sockets)))
      (let ((socket (find-if (lambda (socket)
                               (and (not (activated-socket-claimed socket))
                                    (if name
                                        (equal name (activated-socket-name socket))
                                        (or (member port '(nil 0))
                                            (eql port (activated-socket-port socket))))))
                             *activated-sockets*)))
        (when socket
          (let ((copy (%fcntl (activated-socket-fd socket) +f-dupfd-cloexec+ 0)))
            (when (minusp copy)
              (error "Copying the passed socket ~D failed: errno ~D"
                     (activated-socket-fd socket) (%errno)))
            (setf (activated-socket-claimed socket) copy)
            (return-from claim-activated-socket copy)))
        (unless (or name (member port '(nil 0))
                    (find port *activated-sockets* :key #'activated-socket-port))
          (setf passed-elsewhere (mapcar #'activated-socket-fd *activated-sockets*)))))
    (when passed-elsewhere
      (error "Asked to listen on ~A:~D, but this process was passed listening ~
              sockets (LISTEN_FDS) on ~{~A~^, ~} only: ask for ~:[that port~;one of ~
              those ports~], or port 0 for any passed socket, or give ~
              :activated-socket nil to bind port ~D beside them."
             (or address "*") port (mapcar #'socket-address-string passed-elsewhere)
             (rest passed-elsewhere) port))
    nil))

(defun release-activated-socket (copy)
  "Let another server claim the passed socket of which COPY (an fd from
CLAIM-ACTIVATED-SOCKET, now closed) was a copy.  Nothing for another fd."
  (sb-thread:with-mutex (*activated-sockets-lock*)
    (when (listp *activated-sockets*)
      (dolist (socket *activated-sockets*)
        (when (eql copy (activated-socket-claimed socket))
          (setf (activated-socket-claimed socket) nil))))))

(defun socket-of-fd (fd)
  "An SB-BSD-SOCKETS stream socket object for the socket FD (IPv4 or IPv6,
as its address says)."
  (make-instance (case (socket-family-and-port fd)
                   (10 'sb-bsd-sockets:inet6-socket)
                   (2 'sb-bsd-sockets:inet-socket)
                   (t (error "fd ~D is not an IPv4 or IPv6 socket." fd)))
                 :descriptor fd :type :stream :protocol :tcp))

(defun bind-listen-socket (address port backlog reuse-port)
  "A new IPv4 stream socket bound to ADDRESS (NIL or \"0.0.0.0\": every
address) and PORT (0: any free port), listening with BACKLOG, with
SO_REUSEPORT when REUSE-PORT (and SO_REUSEADDR in any case)."
  (when (and address (find #\: address))
    (error "Gallop binds IPv4 addresses only, not ~S (a supervisor may pass ~
            an IPv6 socket: see the README, \"Deploy\")." address))
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (handler-bind ((error (lambda (e) (declare (ignore e)) (sb-bsd-sockets:socket-close socket))))
      (setf (sb-bsd-sockets:sockopt-reuse-address socket) t)
      (when reuse-port
        (set-reuse-port (sb-bsd-sockets:socket-file-descriptor socket)))
      (sb-bsd-sockets:socket-bind socket
                                  (if (or (null address) (string= address "0.0.0.0"))
                                      #(0 0 0 0)
                                      (sb-bsd-sockets:host-ent-address
                                       (sb-bsd-sockets:get-host-by-name address)))
                                  port)
      (sb-bsd-sockets:socket-listen socket backlog))
    socket))

(defun open-listen-socket (address port backlog &key reuse-port (activated t))
  "A listening SB-BSD-SOCKETS socket for a server, and whether a supervisor
passed it (socket activation; the socket is then a copy, to give back with
RELEASE-ACTIVATED-SOCKET once closed).  ACTIVATED T: a passed socket on
PORT not claimed yet (on any port when PORT is 0), if there is one (an
error when sockets were passed but none is on PORT); a string: the passed socket of that name, an error if there is none; NIL:
never a passed socket.  Otherwise a new socket bound to ADDRESS and PORT
\(BIND-LISTEN-SOCKET, REUSE-PORT too).  A passed socket is the supervisor's:
its address, port and options are as it made them."
  (let ((fd (and activated (claim-activated-socket
                            :name (and (stringp activated) activated) :port port
                            :address address))))
    (cond (fd (values (socket-of-fd fd) t))
          ((stringp activated)
           (error "No listening socket named ~S was passed to this process ~
                   (LISTEN_FDS, LISTEN_FDNAMES)." activated))
          (t (values (bind-listen-socket address port backlog reuse-port) nil)))))
