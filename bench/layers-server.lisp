;;;; layers-server.lisp -- one server of bench/layers.sh: Gallop's engine
;;;; with only some layers of the native path above it, so that the cost of
;;;; each layer per request can be read as a difference.
;;;;
;;;;   scripts/lisp.sh --load bench/layers-server.lisp --end-toplevel-options PORT LAYERS
;;;;
;;;; LAYERS is one of
;;;;   floor    the engine (GALLOP.CORE) alone: the handler takes the checked
;;;;            head and writes /yo's answer from octets made once (status line,
;;;;            Content-Type, Content-Length, "Hey!"; no Date): what a request
;;;;            costs below the native API.
;;;;   table    floor, plus one EQUAL hash table with one entry per request:
;;;;            the :HEADERS table of the environment alone (wrk sends Host only).
;;;;   env      floor, plus the whole environment (GALLOP::MAKE-ENV).
;;;;   respond  floor, but the answer written by the native API's RESPOND
;;;;            (Date line, header names, Content-Length), no environment.
;;;;   native   the native API's whole path (GALLOP::SERVE-REQUEST) with an app
;;;;            that answers /yo as bench/server.lisp's does without the query.
;;;; Every kind answers every path with 200 "Hey!".  This file calls internal
;;;; functions of the native layer (GALLOP::MAKE-ENV, GALLOP::RESPOND,
;;;; GALLOP::SERVE-REQUEST): a measuring tool, not an example.  It prints
;;;; "READY <pid>" once it listens and exits when its standard input ends.

(asdf:load-system "gallop/native")

(defpackage #:gallop-layers (:use #:common-lisp))
(in-package #:gallop-layers)

(defvar *port* (parse-integer (second sb-ext:*posix-argv*)))
(defvar *layers* (intern (string-upcase (third sb-ext:*posix-argv*)) :keyword))

(defparameter +answer+
  (sb-ext:string-to-octets
   (format nil "HTTP/1.1 200 OK~C~CContent-Type: text/plain~C~CContent-Length: 4~C~C~C~CHey!"
           #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))
  "The answer FLOOR writes: /yo's, but for the Date line.")

(defun app (env)
  (declare (ignore env))
  (list 200 '(:content-type "text/plain") (list "Hey!")))

(defvar *server*
  (gallop::%make-server :app #'app :address "127.0.0.1" :port *port* :log *error-output*))

(defvar *kept* nil
  "What the last request made, kept so that the compiler can't drop the work.")

(defun write-canned (c)
  (gallop.core:connection-consume-head c)
  (gallop.core:connection-write-octets c +answer+)
  (gallop.core:connection-flush c)
  :keep-alive)

(defun handler (c)
  (ecase *layers*
    (:floor (write-canned c))
    (:table (let ((table (make-hash-table :test 'equal)))
              (setf (gethash "host" table) "127.0.0.1"
                    *kept* table))
     (write-canned c))
    (:env (setf *kept* (gallop::make-env *server* c))
     (write-canned c))
    (:respond (gallop.core:connection-consume-head c)
     (gallop::respond (gallop::make-exchange c *server* t nil nil)
                      200 '(:content-type "text/plain") (list "Hey!"))
     :keep-alive)
    (:native (gallop::serve-request *server* c))))

;;; In globals: an SB-BSD-SOCKETS socket that becomes garbage is closed by
;;; its finalizer, listening fd and all, at the next collection.
(defvar *socket* (gallop.core:open-listen-socket "127.0.0.1" *port* 1024 :activated nil))
(defvar *engine* (gallop.core:make-engine :name "gallop-layers" :handler #'handler))

(progn
  (setf (gallop::server-engine *server*) *engine*
        (gallop::server-socket *server*) *socket*)
  (gallop.core:engine-start *engine* :listen-fd (sb-bsd-sockets:socket-file-descriptor *socket*))
  (format t "READY ~D~%" (sb-unix:unix-getpid))
  (finish-output)
  (loop while (read-line *standard-input* nil))
  (sb-ext:exit :code 0 :abort t))
