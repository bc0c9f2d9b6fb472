;;;; upload-server.lisp -- a Gallop server in a child process with a small
;;;; heap, for tests/core/uploads.lisp: request bodies far larger than the
;;;; child's whole heap must not exhaust it.
;;;;
;;;;   sbcl --dynamic-space-size 256MB ... --load tests/child/upload-server.lisp \
;;;;        --end-toplevel-options KIND LOG-FILE
;;;;
;;;; KIND is native (GALLOP:START) or easy-acceptor (GALLOP:EASY-ACCEPTOR).
;;;; The server listens on 127.0.0.1 and a free port, logs errors to LOG-FILE,
;;;; and serves:
;;;;   /upload  reads the body to its end in 64 KiB pieces and answers the
;;;;            number of octets read (native: :RAW-BODY; Hunchentoot:
;;;;            (HUNCHENTOOT:RAW-POST-DATA :WANT-STREAM T));
;;;;   /ignore  answers "ignored" without reading the body;
;;;;   /stream  answers "streamed" without reading the body (the
;;;;            easy-acceptor through HUNCHENTOOT:SEND-HEADERS); the one
;;;;            route whose body the server streams to its handler
;;;;            (:STREAMED-BODIES) instead of reading it first;
;;;;   anything else: "ok".
;;;; Talks to the test on standard input/output: prints
;;;; "READY <port> <dynamic space size in octets>" once it listens; "quit" or
;;;; end of file -> exits.

(load (merge-pathnames "protocol.lisp" *load-truename*))
(defpackage #:gallop-upload-server (:use #:common-lisp #:gallop-child))
(in-package #:gallop-upload-server)

(defvar *kind* (child-kind))
(defvar *log* (open (or (third sb-ext:*posix-argv*) "/dev/null")
                    :direction :output :if-exists :append :if-does-not-exist :create))

;; The native server runs on gallop/native alone; Hunchentoot is loaded only
;; so that this file reads.
(asdf:load-system (if (eq *kind* :native) "gallop/native" "gallop"))
(asdf:load-system "hunchentoot")

(defun count-body (stream)
  "Read STREAM to its end in 64 KiB pieces, keeping nothing; the count."
  (let ((buffer (make-array 65536 :element-type '(unsigned-byte 8)))
        (total 0))
    (declare (type fixnum total))
    (loop for n of-type fixnum = (read-sequence buffer stream)
          until (zerop n)
          do (incf total n))
    total))

(defun streamed-p (method path)
  (declare (ignore method))
  (string= path "/stream"))

(defun native-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/upload")
           (list 200 '(:content-type "text/plain")
                 (list (princ-to-string (count-body (getf env :raw-body))))))
          ((string= path "/ignore") '(200 (:content-type "text/plain") ("ignored")))
          ((string= path "/stream") '(200 (:content-type "text/plain") ("streamed")))
          (t '(200 (:content-type "text/plain") ("ok"))))))

(defun hunchentoot-handler (request)
  "The dispatch function of the easy-acceptor: the handler for REQUEST."
  (let ((path (hunchentoot:script-name request)))
    (lambda ()
      (setf (hunchentoot:content-type*) "text/plain")
      (cond ((string= path "/upload")
             (princ-to-string (count-body (hunchentoot:raw-post-data :want-stream t))))
            ((string= path "/ignore") "ignored")
            ((string= path "/stream")
             ;; A handler that streams its answer, not reading the body.
             (setf (hunchentoot:content-length*) 8)
             (let ((out (hunchentoot:send-headers)))
               (write-sequence (map '(vector (unsigned-byte 8)) #'char-code "streamed") out)
               (finish-output out)
               nil))
            (t "ok")))))

(defvar *server*
  (ecase *kind*
    (:native
     (gallop:start #'native-app :address "127.0.0.1" :port 0 :log *log*
                                :streamed-bodies #'streamed-p))
    (:easy-acceptor
     ;; GALLOP::, not GALLOP:, because this file is also read with only
     ;; gallop/native loaded, which does not export the drop-in names.
     (let ((acceptor (make-instance 'gallop::easy-acceptor
                                    :address "127.0.0.1" :port 0
                                    :taskmaster (make-instance 'gallop::taskmaster
                                                               :streamed-bodies #'streamed-p)
                                    :access-log-destination nil
                                    :message-log-destination *log*)))
       (setf hunchentoot:*dispatch-table* (list #'hunchentoot-handler))
       (hunchentoot:start acceptor)))))

(defun port ()
  (if (eq *kind* :native)
      (gallop:server-port *server*)
      (hunchentoot:acceptor-port *server*)))

(reply "READY ~D ~D" (port) (sb-ext:dynamic-space-size))

(loop for line = (read-line *standard-input* nil)
      while (and line (string/= (string-trim " " line) "quit")))

(finish-output *log*)
(sb-ext:exit :code 0 :abort t)
