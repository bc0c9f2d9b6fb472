;;;; running.lisp -- the Gallop servers this process runs, and their end:
;;;; readiness, draining, and a graceful stop on SIGTERM, the same for both
;;;; front ends (the Hunchentoot layer adds its acceptors' methods).
;;;;
;;;; A restart that drops nothing, behind a load balancer: the readiness URL
;;;; answers 503 (DRAIN) while the server still serves, so the balancer stops
;;;; sending; then a soft stop ends the listen socket (its queue is accepted,
;;;; not reset), answers what arrives with Connection: close, and waits for
;;;; requests in flight, within the STOP-TIMEOUT setting.

(in-package #:gallop)

(defvar *running* '()
  "Running Gallop servers: native servers and acceptors served by Gallop,
newest first.  Changed under *RUNNING-LOCK*.")

(defvar *running-lock* (sb-thread:make-mutex :name "gallop running servers"))

(defun note-running (thing runningp)
  "Add THING to the running servers, or remove it."
  (sb-thread:with-mutex (*running-lock*)
    (setf *running* (if runningp
                        (adjoin thing *running*)
                        (remove thing *running*)))))

(defun running-servers ()
  "The Gallop servers this process runs now (GALLOP:START servers, and
Hunchentoot acceptors served by Gallop), newest first."
  (sb-thread:with-mutex (*running-lock*)
    (copy-list *running*)))

(defgeneric server-engine-of (thing)
  (:documentation "The engine serving THING now, or NIL.")
  (:method ((server server))
    (server-engine server)))

(defgeneric stop-softly (thing)
  (:documentation "Stop THING as its front end's soft stop does.")
  (:method ((server server))
    (stop server :soft t)))

(defun ready-p (server)
  "True while SERVER (a GALLOP:START server or an acceptor served by Gallop)
runs and is not draining: what a readiness URL tells a load balancer."
  (let ((engine (server-engine-of server)))
    (and engine (gallop.core:engine-ready-p engine))))

(defun drain (server)
  "Make SERVER's READY-P false while it goes on serving as before, so that a
load balancer polling its readiness URL stops sending to it before it stops."
  (let ((engine (server-engine-of server)))
    (when engine (gallop.core:engine-drain engine))
    server))

(defun readiness-response (env)
  "A native app's answer to the request of ENV (its environment) for a
readiness URL: 200 \"ready\" while the server serving it is READY-P, 503
\"draining\" once it drains or stops."
  (if (gallop.core:engine-ready-p
       (gallop.core:connection-engine (getf env :gallop.connection)))
      (list 200 '(:content-type "text/plain" :cache-control "no-store") '("ready"))
      (list 503 '(:content-type "text/plain" :cache-control "no-store") '("draining"))))

(defvar *terminating* nil
  "True once a graceful stop on SIGTERM has begun: a second SIGTERM then
exits at once.")

(defun stop-all-softly (&key (delay 0))
  "Drain every running server, wait DELAY seconds (for load balancers to see
their readiness fail), then stop them all softly, at once, each within its
STOP-TIMEOUT."
  (let ((servers (running-servers)))
    (mapc #'drain servers)
    (when (plusp delay) (sleep delay))
    (mapc #'sb-thread:join-thread
          (loop for server in servers
                collect (let ((server server))
                          (sb-thread:make-thread
                           (lambda ()
                             (handler-case (stop-softly server)
                               (error (e)
                                 (format *error-output* "~&Gallop: stopping ~A: ~A~%" server e))))
                           :name "gallop soft stop"))))
    servers))

(defun stop-on-sigterm (&key (delay 0) (code 0))
  "On SIGTERM (systemctl stop or restart, docker stop, Kubernetes), stop every
running Gallop server gracefully, then exit with CODE: readiness fails at
once, the servers serve on for DELAY seconds, then each stops softly (see
GALLOP:STOP) within its STOP-TIMEOUT.  A second SIGTERM exits at once, with
CODE.  SBCL's default would exit at once on the first, cutting requests in
flight.  Exit hooks run as usual.  The supervisor's own grace before SIGKILL
must cover DELAY and STOP-TIMEOUT (Docker's is 10 s, Kubernetes' 30 s,
systemd's 90 s)."
  (sb-sys:enable-interrupt
   sb-unix:sigterm
   (lambda (signal info context)
     (declare (ignore signal info context))
     (if (sb-ext:compare-and-swap (symbol-value '*terminating*) nil t)
         (sb-ext:exit :code code :abort t)
         (sb-thread:make-thread (lambda ()
                                  (stop-all-softly :delay delay)
                                  (sb-ext:exit :code code))
                                :name "gallop SIGTERM"))))
  (values))
